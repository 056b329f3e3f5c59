"""Sanity: the checks bite. Two mutants of the fake runner."""
import sys; sys.path.insert(0, "/tmp/s3-3")
import hsfork.pytest_cpu_testbed  # noqa
import test_s3_3_mrv2_mtp_align as T

# M1: postprocess copies from r+bias-1 (off-by-one source column)
src = open("/tmp/s3-3/test_s3_3_mrv2_mtp_align.py").read()
m1 = src.replace('st = self._r_mamba(own, rid, r + bias, "post-src")', 'st = self._r_mamba(own, rid, r + max(bias - 1, 0), "post-src")')
# M2: spec rows also write the state of t=0 into column r-1 (a stale, scheduler-nulled column)
m2 = src.replace('for t in range(q):\n                    self._w_mamba(', 'if r > 0: self._w_mamba(own, rid, r - 1, keys_seq[c + 1], "mutant")\n                for t in range(q):\n                    self._w_mamba(')
for name, code in (("M1 post-src off by one", m1), ("M2 write to column r-1", m2)):
    assert code != src
    ns = {"__name__": "mut", "__file__": "/tmp/s3-3/test_s3_3_mrv2_mtp_align.py"}
    exec(compile(code, "mut", "exec"), ns)
    sim = ns["Sim"](2000, "boundary"); sim.run()
    print(name, "-> write viol", len(sim.viol), "hit bad", len(sim.hit_bad), "mamba read bad", len(sim.mamba_read_bad))
    if sim.viol: print("   first:", sim.viol[0])
    if sim.hit_bad: print("   first hit:", {k: sim.hit_bad[0][k] for k in ("rid", "H")}, sim.hit_bad[0]["bad"][:1])
