import warnings, traceback, torch
torch.cuda.init()
d = torch.device("cuda")
x = torch.randn(4, 4099, device=d)
rows = torch.tensor([2, 2], device=d); ids = torch.tensor([0, 5], device=d)
def check(name, fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(); print(name, "OK")
    except RuntimeError as e:
        print(name, "SYNC", str(e)[:80])
    finally:
        torch.cuda.set_sync_debug_mode("default")
neg = torch.tensor(float("-inf"), device=d)
check("setitem_float", lambda: x.__setitem__((rows, ids), float("-inf")))
check("index_put_dev_value", lambda: x.index_put_((rows, ids), neg))
check("index_fill_flat", lambda: x.view(-1).index_fill_(0, rows * x.shape[1] + ids, float("-inf")))
check("scatter_value", lambda: x.scatter_(1, ids.view(1, 2).expand(4, 2).contiguous(), float("-inf")))
# Full sampler with warn mode to list all syncs
from kiln.sampling import Sampler
import tests.sampling.test_sampler_gpu as T
meta = T.mixed_batch(d)
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    Sampler().sample(x, meta)
torch.cuda.set_sync_debug_mode("default")
for wi in w:
    print("WARN", str(wi.message)[:100], wi.filename, wi.lineno)
