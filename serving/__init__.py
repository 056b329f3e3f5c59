"""Serving end to end: ``vllm serve`` with and without speculation, compared
over the OpenAI-compatible API (issue 7). See ``serving/README.md``;
``python -m serving --help`` lists the jobs."""


class CheckError(RuntimeError):
    """A usage or setup error, printed without a traceback."""
