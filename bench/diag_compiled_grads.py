"""Diagnose: gradients of the compiled drafter vs eager (flex and SDPA), fp32 and bf16 autocast."""
import sys
import torch
sys.path.insert(0, "tests")
from test_gpu_attention import make_arch, make_batch, forward, rel_err, V, H
from pipeline.drafter import DFlashDrafter

def grads(model, base, batch, embed, kind, autocast):
    base.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = forward(model, base.arch, batch, embed if autocast else embed.float(), kind)
    out.float().square().mean().backward()
    return out.detach().float(), {n: p.grad.detach().clone() for n, p in base.named_parameters()}

torch.manual_seed(1)
d = DFlashDrafter(make_arch(["sliding_attention", "full_attention"])).cuda()
comp = torch.compile(d)
embed = torch.randn(V, H, device="cuda", dtype=torch.bfloat16)
batch = make_batch(10, S=768)
for ac in (False, True):
    o_s, g_s = grads(d, d, batch, embed, "sdpa", ac)
    o_f, g_f = grads(d, d, batch, embed, "flex", ac)
    o_c, g_c = grads(comp, d, batch, embed, "flex", ac)
    o_cs, g_cs = grads(comp, d, batch, embed, "sdpa", ac)
    worst = lambda g: max((rel_err(g[n], g_s[n]), n) for n in g_s)
    print(f"autocast={ac}: out flex {rel_err(o_f, o_s):.2e} compiled-flex {rel_err(o_c, o_s):.2e} compiled-sdpa {rel_err(o_cs, o_s):.2e}")
    print(f"  worst grad rel err: eager flex {worst(g_f)}, compiled flex {worst(g_c)}, compiled sdpa {worst(g_cs)}")
    n = "layers.0.input_layernorm.weight"
    print(f"  {n}: norms sdpa {g_s[n].norm():.3e} flex {g_f[n].norm():.3e} cflex {g_c[n].norm():.3e} csdpa {g_cs[n].norm():.3e}")
