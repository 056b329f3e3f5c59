# SPDX-License-Identifier: Apache-2.0
"""``vllm bench serve`` fork vs upstream (issue 7 item 2), the CPU side: the
``vllm bench serve`` and ``vllm serve`` command lines against the fork's
own parsers, the fast-apply prompt set and its exact-match check, the
summary (speedups, fork/upstream ratios, weight-read floor) and plot from
result JSONs shaped like vLLM's, the weight-read-floor arithmetic, and
``benchmarks/gpu_serve_bench.sh`` as dry runs against
``serving.fake_server``: the real ``vllm bench serve`` client for the
fast-apply suite, a stubbed bench command for the 9B-shape suite."""

from __future__ import annotations

import json
import math
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import free_port, run_until_done, subprocess_env

from benchmarks import BenchError
from benchmarks import bench_client as bc
from benchmarks import serve_bench as sb
from benchmarks import serve_report as sr
from benchmarks import weight_floor as wf
from serving import make_model as mm
from serving import servers as sv

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
FAKE = f"{PY} -m serving.fake_server"

# a stand-in for `vllm bench serve`: writes a result JSON of vLLM's shape
STUB_BENCH = r"""
import argparse, json, os
ap = argparse.ArgumentParser()
ap.add_argument("--max-concurrency", type=int)
ap.add_argument("--num-prompts", type=int)
ap.add_argument("--result-dir")
ap.add_argument("--result-filename")
ap.add_argument("--metadata", nargs="*")
ap.add_argument("--random-output-len", type=int, default=128)
a, _ = ap.parse_known_args()
meta = dict(m.split("=", 1) for m in a.metadata)
c = a.max_concurrency
tpot = 6.0 + 0.05 * c + (0.1 if meta["variant"] == "upstream" else 0.0)
doc = {"date": "x", "backend": "openai", "label": meta["label"],
       "num_prompts": a.num_prompts, "request_rate": "inf", "burstiness": 1.0,
       "max_concurrency": c, "duration": 1.0, "completed": a.num_prompts,
       "failed": 0, "total_input_tokens": 256 * a.num_prompts,
       "total_output_tokens": a.random_output_len * a.num_prompts,
       "output_throughput": 1000.0 * c / tpot, "median_tpot_ms": tpot,
       "mean_tpot_ms": tpot, "p99_tpot_ms": tpot * 1.1,
       "median_itl_ms": tpot, "median_ttft_ms": 20.0, **meta}
os.makedirs(a.result_dir, exist_ok=True)
with open(os.path.join(a.result_dir, a.result_filename), "w") as f:
    json.dump(doc, f)
"""


def _result_lines(stdout: str):
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1][7:])


# -- plan and command lines ---------------------------------------------------


def test_plan_interleaves_fork_and_upstream():
    p = sb.plan(["none", "ngram", "mtp"], ["fork", "upstream"])
    assert p == [
        [("none", "fork"), ("none", "upstream")],
        [("ngram", "upstream"), ("ngram", "fork")],
        [("mtp", "fork"), ("mtp", "upstream")],
    ]
    assert bc.num_prompts(1, 16, 4) == 16 and bc.num_prompts(32, 16, 4) == 128
    a = sb.parse_run_args(["--suite", "fastapply", "--model", "/m"])
    assert a.specs == ["none", "ngram", "mtp"] and a.concurrency == [1, 8, 32]
    assert a.dataset == "fastapply" and a.tokenizer == "/m"
    a = sb.parse_run_args(["--suite", "qwen9b", "--model", "/m"])
    assert a.specs == ["none"] and a.concurrency == [1, 8, 32, 64]
    assert a.dataset == "random"


def _argvs(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    fa = bc.bench_argv(
        port=8123,
        model="/m/fa",
        tokenizer="/m/fa/tokenizer",
        served_name="model",
        dataset="fastapply",
        conc=8,
        prompts=32,
        result_dir=tmp_path / "runs",
        result_filename="fastapply-ngram-fork-c8.json",
        metadata={"suite": "fastapply", "spec": "ngram", "variant": "fork"},
        dataset_path=jsonl,
        output_len=128,
    )
    q9 = bc.bench_argv(
        port=8124,
        model="/m/q9",
        tokenizer="/m/q9",
        served_name="model",
        dataset="random",
        conc=64,
        prompts=128,
        result_dir=tmp_path / "runs",
        result_filename="qwen9b-none-upstream-c64.json",
        metadata={"suite": "qwen9b", "spec": "none", "variant": "upstream"},
        input_len=256,
        output_len=128,
    )
    return jsonl, fa, q9


def test_bench_serve_command_lines_parse_with_the_forks_parser(tmp_path):
    """The ``vllm bench serve`` arguments serve_bench builds, through the
    parser ``vllm bench serve`` itself builds (the client's own path)."""
    jsonl, fa, q9 = _argvs(tmp_path)
    runs = tmp_path / "runs.json"
    runs.write_text(
        json.dumps({"runs": [{"name": "fa", "argv": fa}, {"name": "q9", "argv": q9}]})
    )
    proc = run_until_done(
        [PY, "-m", "benchmarks.serve_bench", "client", str(runs), "--parse-only"],
        what="serve_bench client --parse-only",
        cwd=REPO,
        env=subprocess_env(HSFORK_CPU_TESTBED="1", VLLM_LOGGING_LEVEL="ERROR"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got_fa, got_q9 = _result_lines(proc.stdout)
    assert got_fa["dataset_name"] == "custom"
    assert got_fa["dataset_path"] == str(jsonl)
    assert got_fa["skip_chat_template"] and got_fa["disable_shuffle"]
    assert got_fa["no_oversample"] and got_fa["custom_output_len"] == 128
    assert got_fa["ignore_eos"] is False
    assert got_fa["tokenizer"] == "/m/fa/tokenizer" and got_fa["model"] == "/m/fa"
    assert got_q9["dataset_name"] == "random" and got_q9["ignore_eos"] is True
    assert got_q9["random_input_len"] == 256 and got_q9["random_output_len"] == 128
    for got, conc, n, port in ((got_fa, 8, 32, 8123), (got_q9, 64, 128, 8124)):
        assert got["max_concurrency"] == conc and got["num_prompts"] == n
        assert got["port"] == port and got["host"] == "127.0.0.1"
        assert got["served_model_name"] == "model"
        assert got["temperature"] == 0.0 and got["num_warmups"] == conc
        assert got["backend"] == "openai" and got["endpoint"] == "/v1/completions"
        assert got["save_result"] and got["save_detailed"]
        assert got["result_dir"] == str(tmp_path / "runs")
        assert got["percentile_metrics"] == "ttft,tpot,itl,e2el"
        assert got["request_rate"] == math.inf
    assert got_fa["metadata"] == ["suite=fastapply", "spec=ngram", "variant=fork"]
    assert got_q9["result_filename"] == "qwen9b-none-upstream-c64.json"


def test_vllm_serve_command_lines_parse(qwen35_serve_flags, parse_serve_args):
    """The ``vllm serve`` command lines of both suites (serving/host_env.sh's
    flags, serve_check's launcher) through the fork's serve parser."""
    qwen35 = qwen35_serve_flags
    engine = f"{qwen35} --disable-uvicorn-access-log"
    cases = [
        ("fastapply", "ngram", f"{engine} --tokenizer /m/tokenizer "
         "--attention-backend TRITON_ATTN", "4e9"),
        ("fastapply", "mtp", f"{engine} --tokenizer /m/tokenizer "
         "--attention-backend TRITON_ATTN", "4e9"),
        ("qwen9b", "none", f"{engine} --attention-backend FLASH_ATTN", "8e9"),
    ]  # fmt: skip
    cmds = []
    for suite, spec, eng, kv in cases:
        a = sb.parse_run_args(
            ["--suite", suite, "--model", "/m", "--engine-args", eng]
            + ["--kv-bytes", kv, "--port", "8300"]
        )
        ns, srv = sb.server_setup(a, "vllm", spec, "fork")
        srv.port = 8300
        cmd = sv.server_command(ns, srv)
        assert cmd[:3] == ["vllm", "serve", "/m"]
        cmds.append(cmd[2:])
    got = parse_serve_args(
        cmds,
        ["speculative_config", "tokenizer", "attention_backend",
         "kv_cache_memory_bytes", "language_model_only", "served_model_name",
         "max_num_seqs"],
    )  # fmt: skip
    assert got[0]["speculative_config"] == sv.PRESETS["ngram"]
    assert got[1]["speculative_config"] == sv.PRESETS["mtp"]
    assert got[2]["speculative_config"] is None
    assert got[0]["tokenizer"] == "/m/tokenizer"
    assert got[0]["attention_backend"].endswith("TRITON_ATTN")
    assert got[2]["attention_backend"].endswith("FLASH_ATTN")
    assert got[2]["kv_cache_memory_bytes"] == 8_000_000_000
    assert all(g["language_model_only"] is True for g in got)
    assert all(g["served_model_name"] == ["model"] for g in got)
    assert all(g["max_num_seqs"] == 64 for g in got)


# -- prompts and exact match --------------------------------------------------


def test_fastapply_dataset_and_exact_match(tmp_path):
    from harness import fastapply as fa

    path = bc.write_fastapply_dataset(tmp_path / "p.jsonl", 8, 0, 128)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 8
    for row, (p, ans) in zip(rows, fa.make_eval_set(8, 0), strict=True):
        assert row["prompt"] == mm.prompt_text(p)
        assert row["answer"] == mm.prompt_text(ans[:-1])
        assert row["output_tokens"] == 128
    texts = [" " + r["answer"] for r in rows]
    texts[3] = texts[3] + " t1"
    errors = [""] * 8
    errors[5] = "boom"
    res = {"generated_texts": texts, "errors": errors}
    assert bc.exact_match(res, path) == 0.75
    assert bc.exact_match({"output_throughput": 1.0}, path) is None


# -- summary ------------------------------------------------------------------


def _vllm_result(suite, spec, variant, conc, tput, tpot, accept=None) -> dict:
    """A result JSON as `vllm bench serve --save-result --metadata ...` saves
    it (vllm/benchmarks/serve.py: main_async's result_json and benchmark()'s
    result, process_one_metric's mean_/median_/std_/pNN_ keys)."""
    doc = {
        "date": "20261121-000000",
        "endpoint_type": "openai",
        "backend": "openai",
        "label": f"{spec}-{variant}",
        "model_id": "/m",
        "tokenizer_id": "/m",
        "num_prompts": max(16, 4 * conc),
        "suite": suite,
        "spec": spec,
        "variant": variant,
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": conc,
        "duration": 2.0,
        "completed": max(16, 4 * conc),
        "failed": 0,
        "total_input_tokens": 1000,
        "total_output_tokens": int(tput * 2),
        "request_throughput": 8.0,
        "request_goodput": None,
        "output_throughput": tput,
        "total_token_throughput": tput + 500,
        "max_output_tokens_per_s": tput * 1.2,
        "max_concurrent_requests": conc,
        "rtfx": 0.0,
    }
    for m, v in (("ttft", 20.0), ("tpot", tpot), ("itl", tpot), ("e2el", 500.0)):
        doc[f"mean_{m}_ms"] = v * 1.01
        doc[f"median_{m}_ms"] = v
        doc[f"std_{m}_ms"] = 0.1
        for p in ("50", "90", "99"):
            doc[f"p{p}_{m}_ms"] = v * (1 + int(p) / 1000)
    if accept is not None:
        doc.update(
            spec_decode_acceptance_rate=0.5,
            spec_decode_acceptance_length=accept,
            spec_decode_num_drafts=100,
            spec_decode_draft_tokens=300,
            spec_decode_accepted_tokens=150,
            spec_decode_per_position_acceptance_rates=[0.7, 0.5, 0.3],
        )
    return doc


def test_summary_tables_and_plot(tmp_path):
    runs = tmp_path / "in" / "runs"
    runs.mkdir(parents=True)
    # fast-apply: none / ngram / mtp x fork / upstream x 1, 8, 32
    base = {1: 200.0, 8: 1400.0, 32: 4000.0}
    gain = {"none": 1.0, "ngram": 3.0, "mtp": 2.0}
    for spec in ("none", "ngram", "mtp"):
        for variant in ("fork", "upstream"):
            for c in (1, 8, 32):
                g = gain[spec] * (0.8 if variant == "upstream" else 1.0)
                tput = base[c] * g
                tpot = 1000.0 * c / tput
                acc = None if spec == "none" else 1 + g
                doc = _vllm_result("fastapply", spec, variant, c, tput, tpot, acc)
                name = f"fastapply-{spec}-{variant}-c{c}"
                (runs / f"{name}.json").write_text(json.dumps(doc))
    meta = {
        "schema": sr.SCHEMA,
        "suite": "fastapply",
        "exact_match": {"fastapply-ngram-fork-c8": 1.0,
                        "fastapply-ngram-upstream-c8": 0.03},
        "servers": [{"name": "none-fork", "status": "ok", "ready_s": 50.0,
                     "client_s": 20.0, "total_s": 75.0, "exit_code": 0}],
        "skipped": [{"spec": "mtp", "variant": "upstream", "reason": "9 s left"}],
        "config": {"dataset": "fastapply", "concurrency": [1, 8, 32]},
    }  # fmt: skip
    (tmp_path / "in" / "meta.json").write_text(json.dumps(meta))
    # an unrelated JSON is ignored
    (runs / "other.json").write_text(json.dumps({"output_throughput": 1}))
    s = sr.summary_write([tmp_path / "in"], tmp_path / "out", "fastapply")
    assert len(s["rows"]) == 18
    sp = {(x["spec"], x["variant"], x["conc"]): x for x in s["speedups"]}
    assert len(sp) == 12
    assert sp[("ngram", "fork", 8)]["tput_speedup"] == pytest.approx(3.0)
    assert sp[("ngram", "fork", 8)]["tpot_speedup"] == pytest.approx(3.0)
    assert sp[("mtp", "upstream", 32)]["tput_speedup"] == pytest.approx(2.0)
    assert sp[("ngram", "upstream", 8)]["exact_match"] == 0.03
    ratios = {(q["spec"], q["conc"]): q for q in s["fork_over_upstream"]}
    assert ratios[("none", 1)]["tput_ratio"] == pytest.approx(1.25)
    assert ratios[("none", 1)]["tpot_ratio"] == pytest.approx(0.8)
    assert s["weight_read_floor"] is None
    md = (tmp_path / "out" / "fastapply.md").read_text()
    assert "| ngram | fork | 8 | 3.00x | 3.00x |" in md
    assert "## Fork / upstream" in md and "mtp/upstream" in md
    assert json.loads((tmp_path / "out" / "fastapply.json").read_text())["rows"]
    png = tmp_path / "out" / "fastapply.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the 9B shape: no speculation, fork / upstream, and the floor
    runs9 = tmp_path / "in9" / "runs"
    runs9.mkdir(parents=True)
    for variant, tpot1 in (("fork", 6.0), ("upstream", 6.06)):
        for c in (1, 8, 32, 64):
            tpot = tpot1 * (1 + c / 64)
            doc = _vllm_result("qwen9b", "none", variant, c, 1000 * c / tpot, tpot)
            (runs9 / f"qwen9b-none-{variant}-c{c}.json").write_text(json.dumps(doc))
    meta9 = {
        "schema": sr.SCHEMA,
        "suite": "qwen9b",
        "weights": {"decode_bytes": 15_000_000_000},
        "bandwidth": {"copy_gbps": 3000.0, "device": "NVIDIA H100 80GB HBM3"},
    }
    (tmp_path / "in9" / "meta.json").write_text(json.dumps(meta9))
    s9 = sr.summary_write([tmp_path / "in9"], tmp_path / "out9", "qwen9b")
    fl = s9["weight_read_floor"]
    assert fl["floor_ms"] == pytest.approx(5.0)
    assert fl["bs1"]["fork"]["over_floor"] == pytest.approx(6.0 * (1 + 1 / 64) / 5)
    assert not s9["speedups"]
    r = {q["conc"]: q for q in s9["fork_over_upstream"]}
    assert set(r) == {1, 8, 32, 64}
    assert r[64]["tpot_ratio"] == pytest.approx(6.0 / 6.06)
    md9 = (tmp_path / "out9" / "qwen9b.md").read_text()
    assert "floor 5.000 ms per step" in md9 and "(NVIDIA H100 80GB HBM3)" in md9


# -- weight-read floor ---------------------------------------------------------


def _write_safetensors(path: Path, tensors: dict[str, tuple]) -> None:
    entries = [(n, s, "BF16", math.prod(s) * 2) for n, s in tensors.items()]
    with open(path, "wb") as f:
        f.write(mm._header(entries))
        f.write(b"\0" * sum(e[3] for e in entries))


def test_weight_read_floor_arithmetic(tmp_path):
    # the 9B shape's checkpoint plan: a decode step reads the language
    # model without its embedding table, plus lm_head (untied)
    plan = mm.tensor_plan(mm.qwen9b_config())
    w = wf.decode_bytes_of({n: math.prod(s) * 2 for n, s, _, _ in plan})
    assert w["tied"] is False
    assert w["lm_head_bytes"] == w["embed_bytes"] == 248320 * 4096 * 2
    body = sum(
        math.prod(s) * 2
        for n, s, _, _ in plan
        if n.startswith("model.language_model.") and "embed_tokens" not in n
    )
    assert w["decode_bytes"] == body + 248320 * 4096 * 2
    assert 15.5e9 < w["decode_bytes"] < 16.2e9  # ~7.94 B parameters in bf16
    vis_mtp = sum(
        math.prod(s) * 2
        for n, s, _, _ in plan
        if n.startswith(("model.visual", "mtp."))
    )
    assert w["not_read_bytes"] == vis_mtp
    assert w["checkpoint_bytes"] == sum(math.prod(s) * 2 for _, s, _, _ in plan)
    # floor: bytes / (GB/s); 15.87 GB at 3 TB/s is ~5.3 ms
    assert wf.weight_read_floor_ms(3e9, 1000.0) == pytest.approx(3.0)
    assert wf.weight_read_floor_ms(w["decode_bytes"], 3000.0) == pytest.approx(
        w["decode_bytes"] / 3e9
    )
    with pytest.raises(ValueError):
        wf.weight_read_floor_ms(1.0, 0.0)
    # from safetensors headers, over shards; tied embeddings count once
    d = tmp_path / "ckpt"
    d.mkdir()
    _write_safetensors(
        d / "model-00001-of-00002.safetensors",
        {
            "model.language_model.embed_tokens.weight": (100, 8),
            "model.language_model.layers.0.mlp.up_proj.weight": (16, 8),
            "model.visual.blocks.0.attn.qkv.weight": (24, 8),
        },
    )
    _write_safetensors(
        d / "model-00002-of-00002.safetensors",
        {"model.language_model.norm.weight": (8,), "mtp.fc.weight": (8, 16)},
    )
    got = wf.decode_weight_bytes(d)
    assert got["tied"] is True
    assert got["decode_bytes"] == (16 * 8 + 8 + 100 * 8) * 2
    assert got["not_read_bytes"] == (24 * 8 + 8 * 16) * 2
    with pytest.raises(BenchError):
        wf.decode_weight_bytes(tmp_path)


def test_bandwidth_measurement_on_cpu():
    res = wf.measure_bandwidth(1 << 20, iters=3, device="cpu")
    assert res["copy_gbps"] > 0 and res["nbytes"] == 1 << 20
    assert res["method"].startswith("dst.copy_(src)")


# -- the orchestration ---------------------------------------------------------


def test_server_that_never_comes_up(tmp_path):
    """A server not healthy by the deadline: given up, stopped (its process
    group gone), reported, exit status 1."""
    out = tmp_path / "o"
    rc = sb.run_main(
        [
            "--suite", "fastapply", "--model", "/m", "--out", str(out),
            "--variant", f"fork={FAKE}", "--specs", "none",
            "--engine-args", "--fake-startup-s 1000", "--port", str(free_port()),
            "--deadline", "17", "--server-estimate", "1", "--cache-root", "",
        ]
    )  # fmt: skip
    assert rc == 1
    meta = json.loads((out / "meta.json").read_text())
    (srv,) = meta["servers"]
    assert srv["status"] == "not-ready" and srv["name"] == "none-fork"
    assert srv["exit_code"] is not None
    assert "| none-fork | not-ready |" in (out / "fastapply.md").read_text()


def test_gpu_serve_bench_dry_run_fastapply(tmp_path):
    """gpu_serve_bench.sh fastapply against fake servers (fast-apply
    oracle) with the real ``vllm bench serve`` client: the n-gram spec on
    fork and upstream, two concurrencies, every field the summary reads in
    the client's own result JSONs, the tarball and table in $OUT. (The
    speculation-over-none table and the pair interleaving, the same code
    over the same fields, run end to end in the stub-client dry run below:
    the real client costs a vLLM import per server.)"""
    out = tmp_path / "out"
    env = subprocess_env(
        BENCH_BUNDLE_ENV="none",
        BENCH_VLLM_CMD=f"{FAKE} --fake-mode fastapply",
        PYTHON=PY,
        OUT=str(out),
        BENCH_WORK=str(tmp_path / "work"),
        BENCH_SPECS="ngram",
        BENCH_CONC="1,4",
        BENCH_BUDGET="0",  # no budget: the dry run waits for each step
        BENCH_ARGS=f"--port {free_port()} --cache-root {tmp_path}/cache "
        "--server-estimate 10",
        HSFORK_CPU_TESTBED="1",
        VLLM_LOGGING_LEVEL="ERROR",
    )
    proc = run_until_done(
        ["bash", str(REPO / "benchmarks" / "gpu_serve_bench.sh"), "fastapply"],
        what="gpu_serve_bench.sh fastapply (dry run)",
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["fastapply.md", "fastapply.tgz"]
    with tarfile.open(out / "fastapply.tgz") as t:
        names = set(t.getnames())
        run = json.load(t.extractfile("fastapply/runs/fastapply-ngram-fork-c4.json"))
        meta = json.load(t.extractfile("fastapply/meta.json"))
    for v in ("fork", "upstream"):
        for c in (1, 4):
            assert f"fastapply/runs/fastapply-ngram-{v}-c{c}.json" in names
    assert {"fastapply/fastapply.json", "fastapply/fastapply.md"} <= names
    assert run["max_concurrency"] == 4 and run["completed"] == 16
    assert run["spec"] == "ngram" and run["variant"] == "fork"
    assert run["spec_decode_acceptance_length"] == pytest.approx(4.0)
    # vLLM's result JSON holds every metric the summary reads
    assert [k for k in sr.METRICS if k not in run] == []
    assert [s["name"] for s in meta["servers"]] == ["ngram-fork", "ngram-upstream"]
    assert set(meta["exact_match"].values()) == {1.0}
    assert len(meta["exact_match"]) == 4
    md = (out / "fastapply.md").read_text()
    assert "| ngram | fork | 4 |" in md and "## Fork / upstream" in md


def test_gpu_serve_bench_dry_run_qwen9b_stub_bench(tmp_path):
    """gpu_serve_bench.sh qwen9b with the shrunk 9B checkpoint written on
    the CPU, a CPU bandwidth measurement, fake servers and a stubbed
    ``vllm bench serve`` (``--bench-cli``): the floor, the fork/upstream
    table and the speculation-over-none table come out of the JSONs; the
    servers run one at a time, fork and upstream interleaved pair by pair."""
    out = tmp_path / "out"
    stub = tmp_path / "stub_bench.py"
    stub.write_text(STUB_BENCH)
    env = subprocess_env(
        BENCH_BUNDLE_ENV="none",
        BENCH_VLLM_CMD=FAKE,
        PYTHON=PY,
        OUT=str(out),
        BENCH_WORK=str(tmp_path / "work"),
        BENCH_DEVICE="cpu",
        BENCH_MODEL_DIR=str(tmp_path / "model"),
        BENCH_TINY="1",
        BENCH_BANDWIDTH_GIB="0.03125",
        BENCH_BUDGET="0",  # no budget: the dry run waits for each step
        BENCH_ARGS=f"--port {free_port()} --cache-root {tmp_path}/cache "
        "--server-estimate 10",
        BENCH_CLI=f"{PY} {stub}",
        BENCH_SPECS="none,ngram",
    )
    proc = run_until_done(
        ["bash", str(REPO / "benchmarks" / "gpu_serve_bench.sh"), "qwen9b"],
        what="gpu_serve_bench.sh qwen9b (dry run)",
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["qwen9b.md", "qwen9b.tgz"]
    with tarfile.open(out / "qwen9b.tgz") as t:
        summary = json.load(t.extractfile("qwen9b/qwen9b.json"))
        meta = json.load(t.extractfile("qwen9b/meta.json"))
    assert meta["weights"]["decode_bytes"] > 0 and meta["bandwidth"]["copy_gbps"] > 0
    assert meta["config"]["concurrency"] == [1, 8, 32, 64]
    rows = {(r["spec"], r["variant"], r["conc"]) for r in summary["rows"]}
    assert rows == {
        (s, v, c)
        for s in ("none", "ngram")
        for v in ("fork", "upstream")
        for c in (1, 8, 32, 64)
    }
    assert [s["name"] for s in meta["servers"]] == [
        "none-fork",
        "none-upstream",
        "ngram-upstream",
        "ngram-fork",
    ]
    assert len(summary["speedups"]) == 8
    fl = summary["weight_read_floor"]
    assert fl["floor_ms"] == pytest.approx(
        wf.weight_read_floor_ms(meta["weights"]["decode_bytes"], fl["copy_gbps"])
    )
    assert set(fl["bs1"]) == {"fork", "upstream"}
    r1 = next(q for q in summary["fork_over_upstream"] if q["conc"] == 1)
    assert r1["tpot_ratio"] == pytest.approx(6.05 / 6.15)
    md = (out / "qwen9b.md").read_text()
    assert "weight-read floor" in md
    assert "## Speculation over no speculation" in md


def test_summary_cli_merges_folders(tmp_path):
    d = tmp_path / "a"
    d.mkdir()
    for v in ("fork", "upstream"):
        doc = _vllm_result("x", "none", v, 1, 100.0, 10.0)
        (d / f"x-none-{v}-c1.json").write_text(json.dumps(doc))
    assert (
        sb.main(["summary", str(d), "--out", str(tmp_path / "o"), "--name", "x"]) == 0
    )
    assert (tmp_path / "o" / "x.md").exists()
    assert sb.main(["nope"]) == 2
    # a usage error, before anything starts
    bad = ["run", "--suite", "x", "--model", "/m", "--out", str(tmp_path / "r")]
    assert sb.main([*bad, "--variant", "fork"]) == 2
    assert not (tmp_path / "r").exists()


def test_load_results_drops_skips_that_a_later_call_ran(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for d, servers, skipped in (
        (first, [("none", "fork")], [("ngram", "fork"), ("mtp", "fork")]),
        (second, [("ngram", "fork")], []),
    ):
        d.mkdir()
        meta = {
            "schema": sr.SCHEMA,
            "servers": [
                {"name": f"{s}-{v}", "spec": s, "variant": v} for s, v in servers
            ],
            "skipped": [
                {"spec": s, "variant": v, "reason": "time"} for s, v in skipped
            ],
        }
        (d / "meta.json").write_text(json.dumps(meta))
    _, merged = sr.load_results([first, second])
    assert [(s["spec"], s["variant"]) for s in merged["skipped"]] == [("mtp", "fork")]
    assert len(merged["servers"]) == 2
