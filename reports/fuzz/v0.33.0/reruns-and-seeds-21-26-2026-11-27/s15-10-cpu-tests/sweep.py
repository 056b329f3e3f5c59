import sys
sys.path.insert(0, "/tmp/s15-10")
import hsfork.pytest_cpu_testbed  # noqa: F401  (test-bed platform bridge)
from test_s15_10_align_hybrid import _run
tot = {}
for pool in (27, 28, 30):
    for seed in range(8):
        for p in (0.02, 0.3):
            issues, npre, done, n = _run(pool, seed=seed, accept_p=p)
            key = (pool, p)
            a = tot.setdefault(key, [0, 0, 0, 0, 0])
            a[0] += npre; a[1] += len(issues["placeholder_rows"]); a[2] += len(issues["mamba_window_foreign"]); a[3] += len(issues["kv_slot_foreign"]); a[4] += (done != 16)
for k, v in sorted(tot.items()):
    print(f"pool={k[0]} accept_p={k[1]} (8 seeds): preemptions={v[0]} placeholder_rows={v[1]} mamba_window_foreign={v[2]} kv_slot_foreign={v[3]} unfinished_runs={v[4]}")
