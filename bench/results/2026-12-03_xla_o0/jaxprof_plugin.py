import atexit, collections, os, time
import jax.monitoring as m
tot = collections.Counter(); cnt = collections.Counter()
def _l(name, secs, **kw):
  tot[name] += secs; cnt[name] += 1
m.register_event_duration_secs_listener(_l)
t0 = time.time()
@atexit.register
def _dump():
  with open(os.environ.get("JAXPROF_OUT", "/tmp/jaxprof.txt"), "a") as f:
    f.write(f"wall {time.time()-t0:.1f}\n")
    for k, v in tot.most_common():
      f.write(f"{v:8.1f} {cnt[k]:6d} {k}\n")
