"""step_profile's device breakdown, weight bytes and floor report (CPU, no
vLLM engine)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from benchmarks import step_profile as sp
from benchmarks.decode_latency import StepRecord

LM_HEAD = "nvjet_tst_256x8_64x32_2x1_v_bz_splitK_TNT"
BODY_GEMM = "nvjet_tst_64x8_64x16_4x1_v_bz_TNT"
FA3 = "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
NORM = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0"


def one_step(t0: float) -> list[tuple[str, float, float]]:
    """One synthetic step starting at t0 (µs): kernel sum 165, union 160
    (the norm overlaps attention by 5 µs), idle gaps 10 + 5."""
    return [
        (BODY_GEMM, t0 + 0, t0 + 40),
        (BODY_GEMM, t0 + 50, t0 + 90),
        ("fused_recurrent_gated_delta_rule_fwd_kernel", t0 + 90, t0 + 100),
        (FA3, t0 + 100, t0 + 110),
        (NORM, t0 + 105, t0 + 115),
        (LM_HEAD, t0 + 120, t0 + 170),
        ("Memcpy DtoH (Device -> Pinned)", t0 + 170, t0 + 172),
        ("some_unknown_kernel", t0 + 172, t0 + 175),
    ]


def test_union_merges_overlapping_and_nested_intervals():
    assert sp.union_us([(0, 10), (5, 8), (9, 20), (30, 31)]) == 21
    assert sp.union_us([]) == 0


@pytest.mark.parametrize(
    "name, cat",
    [
        (FA3, "attention"),
        ("flash_fwd_splitkv_kernel", "attention"),
        ("reshape_and_cache_flash_kernel", "attention"),
        (BODY_GEMM, "gemm"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"),
        ("fused_recurrent_gated_delta_rule_fwd_kernel", "gdn"),
        ("_causal_conv1d_update_kernel", "conv1d"),
        (NORM, "norm"),
        ("vllm::fused_add_rms_norm_kernel", "norm"),
        ("triton_poi_fused__to_copy_mul_silu_slice_0", "inductor"),
        ("Memset (Device)", "memcpy"),
        ("argmax_kernel", "sampling"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernel_category(name, cat):
    assert sp.kernel_category(name) == cat


def test_device_breakdown_union_sum_idle_and_categories():
    kernels = one_step(0) + one_step(200)
    d = sp.device_breakdown(kernels, steps=2, step_ms=0.5)
    assert d["kernels"] == 16 and d["steps"] == 2
    assert d["kernel_ms_per_step"] == pytest.approx(0.165)
    assert d["busy_ms_per_step"] == pytest.approx(0.160)
    assert d["span_ms"] == pytest.approx(0.375)
    # per step 10 + 5 µs between kernels, and 25 µs between the two steps
    assert d["idle_ms_per_step"] == pytest.approx((375 - 320) / 2 / 1e3)
    assert d["step_ms"] == 0.5
    assert d["host_gap_ms"] == pytest.approx(0.5 - 0.160)
    c = d["categories"]
    assert list(c) == list(sp.CATEGORY_NAMES)
    assert c["gemm"]["count"] == 6
    assert c["gemm"]["ms_per_step"] == pytest.approx(0.130)
    assert c["gemm"]["share"] == pytest.approx(130 / 165)
    assert c["attention"]["ms_per_step"] == pytest.approx(0.010)
    assert c["gdn"]["count"] == 2 and c["norm"]["count"] == 2
    assert c["memcpy"]["ms_per_step"] == pytest.approx(0.002)
    assert c["other"]["ms_per_step"] == pytest.approx(0.003)
    assert c["conv1d"]["count"] == 0 and c["conv1d"]["share"] == 0
    assert sum(x["share"] for x in c.values()) == pytest.approx(1.0)
    top = d["top"]
    assert [t["name"] for t in top[:2]] == [BODY_GEMM, LM_HEAD]
    assert top[0]["total_ms"] == pytest.approx(0.16) and top[0]["count"] == 4
    assert top[1]["mean_us"] == 50 and top[1]["category"] == "gemm"
    assert len(top) == 7  # distinct names
    assert d["largest_gemm"]["name"] == LM_HEAD
    assert d["largest_gemm"]["mean_us"] == 50 and d["largest_gemm"]["count"] == 2


def test_largest_gemm_is_about_once_per_step():
    # a longer GEMM launched 5 times per step is not the once-per-step one
    steps = 4
    kernels = [(LM_HEAD, 1000 * i, 1000 * i + 300) for i in range(steps)]
    kernels += [(BODY_GEMM, 1000 * i + 400 + 100 * j, 1000 * i + 490 + 100 * j)
                for i in range(steps) for j in range(5)]  # fmt: skip
    kernels += [("sm90_xmma_gemm_once", 5000, 5900)]  # once in 4 steps: too rare
    d = sp.device_breakdown(kernels, steps=steps)
    assert d["largest_gemm"]["name"] == LM_HEAD
    assert d["largest_gemm"]["mean_us"] == 300 and d["largest_gemm"]["count"] == 4
    assert "host_gap_ms" not in d and "step_ms" not in d
    long_names = [(("x" * 200), 0, 1)]
    assert len(sp.device_breakdown(long_names, 1)["top"][0]["name"]) == 120
    assert sp.device_breakdown(long_names, 1)["largest_gemm"] is None


def test_device_breakdown_rejects_no_steps_or_no_kernels():
    with pytest.raises(ValueError, match="steps"):
        sp.device_breakdown(one_step(0), steps=0)
    with pytest.raises(ValueError, match="no device kernel"):
        sp.device_breakdown([], steps=3)


def ev(name, start, end, dev=DeviceType.CUDA, act="kernel", annotation=False):
    return SimpleNamespace(
        name=name,
        device_type=dev,
        activity_type=act,
        is_user_annotation=annotation,
        time_range=SimpleNamespace(start=start, end=end),
    )


def test_kernel_events_keeps_kernels_copies_and_sets_only():
    events = [
        ev("aten::mm", 0, 50, dev=DeviceType.CPU, act="cpu_op"),
        ev(sp.STEP_MARK, 0, 60, act="gpu_user_annotation", annotation=True),
        ev("cudaStreamSynchronize", 55, 60, act="cuda_sync"),
        ev(BODY_GEMM, 1, 20),
        ev("Memcpy DtoH (Device -> Pinned)", 20, 22, act="gpu_memcpy"),
        ev("Memset (Device)", 22, 23, act="gpu_memset"),
    ]
    kernels, skipped = sp.kernel_events(events)
    assert kernels == [
        (BODY_GEMM, 1.0, 20.0),
        ("Memcpy DtoH (Device -> Pinned)", 20.0, 22.0),
        ("Memset (Device)", 22.0, 23.0),
    ]
    assert skipped == {"gpu_user_annotation": 1, "cuda_sync": 1}


def test_kernels_in_steps_assigns_by_window_start():
    windows = [(0, 100), (200, 300), (400, 500)]
    ks = [("a", -5, 1), ("b", 10, 20), ("c", 150, 160), ("d", 250, 260),
          ("e", 350, 360), ("f", 450, 460), ("g", 600, 610)]  # fmt: skip
    got = sp.kernels_in_steps(ks, windows, [False, True, True])
    # c (after window 0's host range) stays with window 0; g is past the end
    assert [k[0] for k in got] == ["d", "e", "f"]


def rec(rows: int, prefill: int) -> StepRecord:
    return StepRecord(0.005, rows, prefill, rows, 0, rows, 0, 0, 0)


def test_device_from_events_takes_full_batch_decode_steps():
    marks = [(0, 100), (200, 300), (400, 500), (600, 700)]
    events = [ev(sp.STEP_MARK, a, b, dev=DeviceType.CPU, act="user_annotation",
                 annotation=True) for a, b in marks]  # fmt: skip
    events += [ev("prefill_gemm_kernel", 10, 90), ev(BODY_GEMM, 210, 250),
               ev(BODY_GEMM, 410, 450), ev(BODY_GEMM, 610, 690)]  # fmt: skip
    # prefill, decode, get_output without a step, decode at a smaller batch
    calls = [rec(2, 2), rec(2, 0), None, rec(1, 0)]
    d = sp.device_from_events(lambda: events, calls, 2, 1.0, all_steps=3)
    assert d["steps"] == 1 and d["kernels"] == 1
    assert d["busy_ms_per_step"] == pytest.approx(0.040)
    assert d["host_gap_ms"] == pytest.approx(0.960)
    assert d["steps_basis"].startswith("full-batch decode")
    assert d["device_events"] == 4
    # ranges that do not line up with the calls: every kernel, every step
    d = sp.device_from_events(events, calls[:3], 2, None, all_steps=3)
    assert d["steps"] == 3 and d["kernels"] == 4
    assert d["kernel_ms_per_step"] == pytest.approx(0.240 / 3)
    assert d["steps_basis"].startswith("all 3 engine steps")


def test_device_from_events_reports_api_differences_and_cpu_profiles():
    bad = [SimpleNamespace(name="k", device_type=DeviceType.CUDA)]
    d = sp.device_from_events(bad, [], 1, None, all_steps=1)
    assert d["error"].startswith("AttributeError") and "time_range" in d["reads"]
    # a real CPU-only profile: the step mark is found, there are no kernels
    from torch.profiler import ProfilerActivity, profile, record_function

    with (
        profile(activities=[ProfilerActivity.CPU]) as prof,
        record_function(sp.STEP_MARK),
    ):
        torch.ones(4).sum()
    assert len(sp.step_windows(prof.events())) == 1
    assert sp.kernel_events(prof.events()) == ([], {})
    d = sp.device_from_events(prof.events, [rec(1, 0)], 1, None, all_steps=1)
    assert d["error"].startswith("ValueError: no device kernel events")


NAMES_UNTIED = [
    ("language_model.model.embed_tokens.weight", 1000),
    ("language_model.model.layers.0.mlp.down_proj.weight", 300),
    ("language_model.model.norm.weight", 8),
    ("language_model.lm_head.weight", 1000),
    ("mtp.layers.0.mlp.weight", 50),
    ("language_model.model.mtp.fc.weight", 20),
    ("visual.blocks.0.attn.qkv.weight", 70),
]


def test_classify_param_bytes_untied_tied_and_mtp():
    got = sp.classify_param_bytes(NAMES_UNTIED)
    assert got == {
        "decode_bytes": 1308,
        "body_bytes": 308,
        "lm_head_bytes": 1000,
        "embed_bytes": 1000,
        "mtp_bytes": 70,
        "vision_bytes": 70,
        "tied": False,
    }
    tied = sp.classify_param_bytes(
        [(n, b) for n, b in NAMES_UNTIED if "lm_head" not in n]
    )
    assert tied["tied"] is True and tied["lm_head_bytes"] == 1000
    assert tied["decode_bytes"] == 1308 and tied["embed_bytes"] == 1000
    bare = sp.classify_param_bytes([("layers.0.weight", 5)])
    assert bare["tied"] is False and bare["decode_bytes"] == 5


class Tiny(torch.nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(10, 4)  # 160 bytes
        self.model.layer = torch.nn.Linear(4, 4, bias=False)  # 64 bytes
        self.lm_head = torch.nn.Linear(4, 10, bias=False, dtype=torch.bfloat16)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight


def test_weight_bytes_reads_the_loaded_model():
    untied = sp.weight_bytes(SimpleNamespace(get_model=lambda: Tiny(tie=False)))
    assert untied["decode_bytes"] == 64 + 80 and untied["lm_head_bytes"] == 80
    assert untied["embed_bytes"] == 160 and not untied["tied"]
    assert untied["params"] == 3 and untied["model_class"] == "Tiny"
    # a wrapper without get_model: .model, unwrapped
    wrapper = SimpleNamespace(unwrap=lambda: Tiny(tie=True))
    tied = sp.weight_bytes(SimpleNamespace(model=wrapper))
    assert tied["tied"] and tied["params"] == 2
    assert tied["decode_bytes"] == 64 + 160 and tied["lm_head_bytes"] == 160


def test_floor_fields():
    w = {"decode_bytes": 2e9, "lm_head_bytes": 5e8}
    bw = {"copy_gbps": 2000.0}
    got = sp.floor_fields(1.32, w, bw)
    assert got["floor_ms"] == pytest.approx(1.0)
    assert got["step_over_floor"] == pytest.approx(1.32)
    assert got["lm_head_floor_ms"] == pytest.approx(0.25)
    assert sp.floor_fields(1.32, w, None) == {} == sp.floor_fields(None, w, bw)


def test_copy_bandwidth_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sp.copy_bandwidth() == {"bandwidth_error": "no CUDA device"}


def device_row() -> dict:
    cats = {c: {"ms_per_step": 0.0, "share": 0.0, "count": 0}
            for c in sp.CATEGORY_NAMES}  # fmt: skip
    cats["gemm"] = {"ms_per_step": 5.9, "share": 5.9 / 6.7, "count": 620}
    cats["gdn"] = {"ms_per_step": 0.5, "share": 0.5 / 6.7, "count": 744}
    cats["norm"] = {"ms_per_step": 0.3, "share": 0.3 / 6.7, "count": 2000}
    return {
        "kernels": 4000,
        "steps": 31,
        "busy_ms_per_step": 6.5,
        "kernel_ms_per_step": 6.7,
        "span_ms": 210.0,
        "idle_ms_per_step": 0.25,
        "categories": cats,
        "top": [],
        "largest_gemm": {
            "name": LM_HEAD,
            "count": 31,
            "mean_us": 800.0,
            "max_us": 810.0,
        },  # fmt: skip
        "step_ms": 7.0,
        "host_gap_ms": 0.5,
        "steps_basis": "full-batch decode steps (marked get_output ranges)",
        "profiled_step_ms": 7.4,
    }


def floor_doc() -> dict:
    return {
        "variant": "fork",
        "mode": "none",
        "weights": {"decode_bytes": 15e9, "body_bytes": 13e9,
                    "lm_head_bytes": 2e9, "embed_bytes": 2e9, "mtp_bytes": 0,
                    "vision_bytes": 0, "tied": False},  # fmt: skip
        "bandwidth": {"copy_gbps": 3000.0, "device": "H100", "method": "copy"},
        "results": [
            {"bs": 1, "median_ms": 7.0, "floor_ms": 5.0, "step_over_floor": 1.4,
             "lm_head_floor_ms": 0.5, "methods": {}, "device": device_row()},
            {"bs": 8, "median_ms": 8.0, "floor_ms": 5.0, "step_over_floor": 1.6,
             "lm_head_floor_ms": 0.5, "methods": {},
             "device": {"error": "ValueError: no device kernel events"}},
        ],
    }  # fmt: skip


def test_floor_report_splits_the_gap(tmp_path, capsys):
    path = tmp_path / "step_profile.json"
    path.write_text(json.dumps(floor_doc()))
    assert sp.main(["--floor", str(path)]) == 0
    md = capsys.readouterr().out
    assert "# Decode step vs the weight-read floor: fork (none)" in md
    assert "Weights read per decode step: 15.000 GB (body 13.000 GB" in md
    assert "Copy bandwidth 3000.0 GB/s (H100" in md
    for line in (
        "| step (median, unprofiled run) | 7.000 | |",
        "| weight-read floor | 5.000 | |",
        "| step / floor | 1.400x | |",
        "| gap: step - floor | 2.000 | 100.0% |",
        "| (a) host and launch gaps: step - device busy | 0.500 | 25.0% |",
        "| (b) kernel time above the floor: device busy - floor | 1.500 | 75.0% |",
        "| (b) of which gemm kernels - floor | 0.900 | 45.0% |",
        "| (b) of which gdn kernels | 0.500 | 25.0% |",
        "| (b) of which norm kernels | 0.300 | 15.0% |",
        "| (b) of which overlap: -(kernel sum - busy) | -0.200 | -10.0% |",
    ):
        assert line in md, line
    assert "of which attention" not in md  # no such kernels in the row
    assert f"`{LM_HEAD}` (31 launches), takes 0.800 ms" in md
    assert "take 0.500 ms (1.60x)" in md
    assert "median step 7.400 ms under the profiler" in md
    assert "0.250 ms/step between its first and last kernel" in md
    bs8 = md.split("## BS 8")[1]
    assert "| step / floor | 1.600x | |" in bs8
    assert "No device breakdown: ValueError: no device kernel events" in bs8


def test_floor_report_without_floor():
    doc = floor_doc()
    del doc["bandwidth"]
    doc["bandwidth_error"] = "no CUDA device"
    for r in doc["results"]:
        del r["floor_ms"]
    md = sp.floor_report(doc)
    assert "No floor: no CUDA device" in md
    assert md.count("No step median or no floor in this row.") == 2


def write(tmp_path, name: str, doc: dict) -> str:
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(doc))
    return str(p)


def old_doc(variant: str) -> dict:
    return {"variant": variant, "results": [{"bs": 1, "median_ms": 3.0, "methods": {
        "runner.x": {"calls": 2, "total_ms": 1, "us_per_step": 30.0,
                     "results": {}}}}]}  # fmt: skip


def test_compare_without_device_fields_renders_as_before(tmp_path):
    text = sp.compare([write(tmp_path, "a", old_doc("a")),
                       write(tmp_path, "b", old_doc("b"))])  # fmt: skip
    assert "| median ms/step | 3.000 | 3.000 |" in text
    assert "| runner.x µs/step | 30.0 | 30.0 |" in text
    assert "device busy" not in text and "floor ms" not in text


def test_compare_with_device_and_floor_fields(tmp_path):
    new = floor_doc()
    new["variant"] = "upstream"
    new["results"][0]["methods"] = old_doc("x")["results"][0]["methods"]
    text = sp.compare([write(tmp_path, "a", old_doc("fork")),
                       write(tmp_path, "b", new)])  # fmt: skip
    bs1 = text.split("## BS 8")[0]
    for line in (
        "| | fork | upstream |",
        "| median ms/step | 3.000 | 7.000 |",
        "| device busy ms/step | - | 6.500 |",
        "| device idle ms/step | - | 0.250 |",
        "| gemm kernels ms/step | - | 5.900 |",
        "| gdn kernels ms/step | - | 0.500 |",
        "| norm kernels ms/step | - | 0.300 |",
        "| floor ms | - | 5.000 |",
        "| step/floor | - | 1.400 |",
        "| runner.x µs/step | 30.0 | 30.0 |",
    ):
        assert line in bs1, line
    assert "attention kernels" not in bs1
    bs8 = text.split("## BS 8")[1]
    assert "device busy" not in bs8  # the only BS 8 device entry is an error
    assert "| step/floor | - | 1.600 |" in bs8
    assert "upstream device breakdown: ValueError: no device kernel events" in bs8


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_profile_tables_marks_each_engine_step(tmp_path, monkeypatch):
    """The profiled run on a fake in-process engine: five get_output calls
    (a prefill step, then four decode steps), each inside a marked range;
    one synthetic kernel per range stands in for the CUDA events."""
    pytest.importorskip("vllm.inputs")  # dl.generate builds TokensPrompt

    class Meter:
        records = None

        def start(self):
            self.records = []

        def stop(self):
            recs, self.records = self.records, None
            return recs

    meter = Meter()

    def get_output():
        torch.ones(8).sum()
        meter.records.append(rec(1, 1 if not meter.records else 0))

    def generate(prompts, sampling, use_tqdm=False):
        for _ in range(5):
            client.get_output()
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1])])]

    client = SimpleNamespace(get_output=get_output)
    llm = SimpleNamespace(llm_engine=SimpleNamespace(engine_core=client),
                          generate=generate)  # fmt: skip
    monkeypatch.setattr(
        sp,
        "kernel_events",
        lambda events: (
            [(BODY_GEMM, a + 1, a + 3) for a, _ in sp.step_windows(events)],
            {},
        ),
    )
    path = tmp_path / "profile-bs1.txt"
    dev = sp.profile_tables(llm, meter, [[5, 6]], None, path, 1, step_ms=1.0)
    assert client.get_output is get_output  # unwrapped again
    assert dev["steps"] == 4 and dev["kernels"] == 4
    assert dev["steps_basis"].startswith("full-batch decode")
    assert dev["busy_ms_per_step"] == pytest.approx(0.002)
    assert dev["profiled_step_ms"] == pytest.approx(5.0)  # rec()'s dt
    assert sp.STEP_MARK in path.read_text()
