"""The configuration module a generated fixture ships beside its
config.json when neither transformers nor vLLM has a config class for the
architecture (published checkpoints bring theirs as remote code): a
``PretrainedConfig`` subclass that keeps the keys vLLM's model reads as
attributes and passes the rest on. ``config.json``'s ``auto_map`` names it,
and the fixture's engine arguments set ``trust_remote_code``: the code is
ours, written by the harness."""

from __future__ import annotations

from pathlib import Path


def config_module(doc: str, cls: str, model_type: str, keys: tuple[str, ...]) -> str:
    """The module's source: docstring ``doc``, class ``cls`` of
    ``model_type`` storing ``keys``."""
    return f'''"""{doc}"""

from transformers import PretrainedConfig

KEYS = {keys!r}


class {cls}(PretrainedConfig):
    model_type = "{model_type}"

    def __init__(self, **kwargs):
        for key in KEYS:
            if key in kwargs:
                setattr(self, key, kwargs.pop(key))
        super().__init__(**kwargs)
'''


def write_config_module(out: str | Path, file: str, source: str) -> None:
    """``source`` as ``file`` beside the fixture's config.json in ``out``."""
    (Path(out) / file).write_text(source)
