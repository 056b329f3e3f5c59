import sys; sys.path.insert(0, "/tmp/s3-3")
import hsfork.pytest_cpu_testbed  # noqa
from test_s3_3_mrv2_mtp_align import Sim
sim = Sim(2000, "boundary")
comp = {}
orig = sim.execute
def ex(so):
    comp[sim.step + 1] = {r: (so.num_scheduled_tokens[r], len(so.scheduled_spec_decode_tokens.get(r, ()))) for r in so.num_scheduled_tokens}
    return orig(so)
sim.execute = ex
sim.run()
for h in sim.hit_info:
    w = h.get("mamba_hit_writer")
    wb = comp[w[0]] if w else {}
    ab = comp[h["step"]]
    print(h["rid"], "Q", h["Q"], "Q%80", h["Q_mod_80"], "H", h["H"], "writer", w and (w[0], w[4]),
          "| writer batch rows", len(wb), "uniform q" , sorted({v[0] for v in wb.values()}),
          "| admit: own q", ab[h["rid"]], "rows", len(ab), "other prefills", sum(1 for r, v in ab.items() if r != h["rid"] and v[1] == 0 and v[0] > 1))
