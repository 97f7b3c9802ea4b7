"""Feature encodings (pipeline.encoding): exact bf16, fp8 and the intN group formats, on activations with
"massive" outlier channels, and the store/loader plumbing of their parts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.store_dataset import collate
from pipeline.encoding import ENCODINGS, INT_BITS, LAST, OUTLIERS, decode, encode, from_storage, parts_spec, \
    raw_bytes_per_token, to_storage


def activations(T=256, L=3, H=256, seed=0, massive=True) -> torch.Tensor:
    """Log-normal channel scales, plus (massive=True) two channels per layer at 300-1000x the median."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, L, H, generator=g) * torch.exp(torch.randn(L, H, generator=g) * 0.7)
    if massive:
        med = x.abs().median()
        x[:, :, 5] = (torch.rand(T, L, generator=g) * 700 + 300) * med
        x[:, :, 77] = -(torch.rand(T, L, generator=g) * 700 + 300) * med
    return x.to(torch.bfloat16)


def rel(y, x):
    return ((y - x).norm() / x.norm()).item()


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_parts_match_spec_and_round_trip_through_storage(encoding):
    x = activations()
    parts = encode(x, encoding)
    spec = parts_spec(encoding, 3, 256)
    assert set(parts) == set(spec)
    for k, (shape, dt) in spec.items():
        assert tuple(parts[k].shape) == (256, *shape)
        assert to_storage(parts[k]).dtype == np.dtype(dt)
    assert sum(to_storage(p).nbytes for p in parts.values()) == 256 * raw_bytes_per_token(encoding, 3, 256)
    stored = {k: from_storage(to_storage(v)) for k, v in parts.items()}
    torch.testing.assert_close(decode(stored, encoding, torch.float32), decode(parts, encoding, torch.float32))


def test_bf16_is_exact_and_int_error_halves_per_bit():
    x = activations(massive=False)
    xf = x.float()
    assert torch.equal(decode(encode(x, "bf16"), "bf16", torch.float32), xf)
    errs = {n: rel(decode(encode(x, e), e, torch.float32), xf) for e, n in INT_BITS.items()}
    assert errs[4] < 0.11 and errs[8] < 0.006  # measured 0.095 and 0.0053 (log-normal channel scales)
    assert errs[4] > 1.7 * errs[5] > 1.7 ** 2 * errs[6]  # each bit roughly halves the error


@pytest.mark.parametrize("encoding", ["fp8", "int8", "int6", "int5", "int4", "int4+int8last"])
def test_no_collapse_on_massive_activation_channels(encoding):
    """The ordinary channels keep their accuracy next to outliers 1000x larger (per-token int8 would not)."""
    x = activations(massive=True)
    xf = x.float()
    y = decode(encode(x, encoding), encoding, torch.float32)
    normal = torch.ones(256, dtype=torch.bool)
    normal[[5, 77]] = False
    err_normal = rel(y[..., normal], xf[..., normal])
    base = rel(decode(encode(activations(massive=False), encoding), encoding, torch.float32),
               activations(massive=False).float())
    assert err_normal < 1.5 * base + 1e-3, (err_normal, base)
    if encoding != "fp8":  # the outliers themselves are kept exactly
        assert torch.equal(y[..., [5, 77]], xf[..., [5, 77]])
    # the group next to an outlier channel (channels 0..31 hold channel 5) is not quantised to zero
    assert rel(y[..., 0:5], xf[..., 0:5]) < 0.2


def test_per_token_int8_would_collapse_there():
    """Why the group formats: one scale per token and layer (amax / 127) crushes the ordinary channels."""
    x = activations(massive=True).float()
    s = x.abs().amax(-1, keepdim=True) / 127
    y = (x / s).round() * s
    normal = torch.ones(256, dtype=torch.bool)
    normal[[5, 77]] = False
    assert rel(y[..., normal], x[..., normal]) > 0.3


def test_decode_works_on_padded_batches():
    """The loader pads encoded parts; decoding a [B, S, ...] batch equals decoding each sample."""
    for encoding in ("fp8", "int4", "int5+int8last"):
        items = []
        for n, seed in ((7, 1), (12, 2)):
            x = activations(T=n, seed=seed)
            items.append({"tokens": torch.zeros(n, dtype=torch.long), "loss_mask": torch.ones(n, dtype=torch.bool),
                          "anchors": torch.zeros(1, dtype=torch.long), **encode(x, encoding)})
        batch = collate(items)
        y = decode(batch, encoding, torch.float32)  # [2, 12, L, H]
        assert y.shape == (2, 12, 3, 256) and torch.isfinite(y).all()
        for b, it in enumerate(items):
            n = len(it["tokens"])
            torch.testing.assert_close(y[b, :n], decode(it, encoding, torch.float32))


def test_mixed_by_layer_is_its_two_encodings():
    """int4+int8last: the deepest captured layer in int8, the others in int4, decoded back in layer order."""
    x = activations(L=4)
    y = decode(encode(x, "int4+int8last"), "int4+int8last", torch.float32)
    torch.testing.assert_close(y[:, :3], decode(encode(x[:, :3], "int4"), "int4", torch.float32), rtol=0, atol=0)
    torch.testing.assert_close(y[:, 3:], decode(encode(x[:, 3:], "int8"), "int8", torch.float32), rtol=0, atol=0)
    bpt = raw_bytes_per_token("int4+int8last", 5, 5120)
    assert bpt == raw_bytes_per_token("int4", 4, 5120) + raw_bytes_per_token("int8", 1, 5120)
    with pytest.raises(ValueError, match="at least 2 captured layers.*use int5"):
        parts_spec("int5+int8last", 1, 256)


def test_unknown_encoding_and_bad_hidden_size_are_clear():
    with pytest.raises(ValueError, match="unknown feature encoding 'int3'.*bf16, fp8"):
        parts_spec("int3", 5, 5120)
    with pytest.raises(ValueError, match="divisible by 32.*use bf16 or fp8"):
        encode(torch.randn(4, 2, 100), "int4")
    assert OUTLIERS == 4 and raw_bytes_per_token("int4", 5, 5120) / (5 * 5120 * 2) < 1 / 3.5


@pytest.mark.gpu
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_gpu_encode_decode_equals_cpu(encoding):
    """Extraction encodes on the GPU and training decodes there: both must equal the CPU reference."""
    x = activations(T=512, L=5, H=512)
    cpu = encode(x, encoding)
    y_cpu = decode(cpu, encoding, torch.float32)
    # decoding on the GPU (training) gives what the CPU gives
    torch.testing.assert_close(decode({k: v.cuda() for k, v in cpu.items()}, encoding, torch.float32).cpu(),
                               y_cpu, rtol=1e-6, atol=1e-6)
    # encoding on the GPU (extraction) is as accurate as on the CPU; the intN codes are the same but for rare
    # rounding ties (fp8: the CPU and CUDA float->e4m3 casts differ on ~half of the values, measured on the
    # H200 with torch 2.11, so only the error is compared)
    y_gpu = decode(encode(x.cuda(), encoding), encoding, torch.float32).cpu()
    if encoding != "fp8":
        same = (y_gpu == y_cpu).float().mean().item()
        assert same > 0.999, same
    assert rel(y_gpu, x.float()) < 1.05 * rel(y_cpu, x.float()) + 1e-6


def heavy_rows(T=192, L=5, H=5120, seed=4) -> torch.Tensor:
    """27B-shaped activations [T, L, H] bf16: log-normal channel scales, massive channels at 100-1000x the median
    (the first and last channels of groups far apart too), a few rows rounded to 7 levels (many equal magnitudes
    across the row), an all-zero row and an all -0.0 row."""
    x = activations(T, L, H, seed).float()
    g = torch.Generator().manual_seed(seed)
    med = x.abs().median()
    for c in (0, H // 5 + 8, H // 2 - 1, H - 1):
        x[:, :, c] = (torch.rand(T, L, generator=g) * 900 + 100) * med * torch.randn(T, L, generator=g).sign()
    x[:4] = (x[:4] / med).round().clamp(-3, 3) * med
    x[4, 0], x[5, 1] = 0.0, -0.0
    return x.to(torch.bfloat16)


def tied_rows(T=64, L=3, H=128, seed=5) -> torch.Tensor:
    """Values on 4 levels of magnitude [T, L, H] bf16 (every row's 4 largest |x| are ties), with zero rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (T, L, H), generator=g) * 0.25
    x[0, 0], x[0, 1] = 0.0, -0.0
    return x.to(torch.bfloat16)


def kernel_parts_are_the_reference(x: torch.Tensor, n: int, parts: dict) -> None:
    """`parts` (encode's intN parts of x, from the kernel) against the CPU reference: its channels are the 4 largest
    |x|, the lowest channel first among equal magnitudes (so torch.topk's magnitudes, in its order), and its bytes
    are `_encode_int_at`'s at those channels, to the bit."""
    from pipeline.encoding import _encode_int_at

    f, s, o = (parts[k].cpu() for k in ("features", "scales", "outliers"))
    xf = x.cpu().to(torch.bfloat16).float()  # [..., H]
    top = ((o >> 16) & 0xFFFF).long()  # [..., 4] the kernel's channels
    assert torch.equal(top, torch.sort(-xf.abs(), dim=-1, stable=True).indices[..., :OUTLIERS]), n
    assert torch.equal(xf.abs().gather(-1, top), xf.abs().topk(OUTLIERS, dim=-1).values), n
    ref = _encode_int_at(xf, top, n)
    for k, v in (("features", f), ("scales", s), ("outliers", o)):
        assert v.dtype == ref[k].dtype and torch.equal(v, ref[k]), (n, k, (v != ref[k]).sum().item())


def test_the_cpu_encode_is_the_reference_at_the_kernels_channels_but_where_magnitudes_tie():
    """The CPU's intN parts (torch.topk's outliers) equal `_encode_int_at` at the lowest-channel-first outliers (the
    GPU kernel's, tested equal to it there) on every row without a tie among its 5 largest |x|: so the GPU's and the
    CPU's stores differ only where torch.topk's order is unspecified."""
    from pipeline.encoding import _encode_int, _encode_int_at

    x = heavy_rows(T=32, L=2, H=512)
    xf = x.float()
    top = torch.sort(-xf.abs(), dim=-1, stable=True).indices[..., :OUTLIERS]
    five = xf.abs().topk(OUTLIERS + 1, dim=-1).values
    tied = (five[..., 1:] == five[..., :-1]).any(-1)  # [T, L]
    assert 4 <= tied.sum() < tied.numel() // 2  # the rounded rows and the zero rows
    for n in INT_BITS.values():
        cpu, ref = _encode_int(x, n), _encode_int_at(xf, top, n)
        for k in cpu:
            assert torch.equal(cpu[k][~tied], ref[k][~tied]), (n, k)


def check_int_kernel(device: str) -> None:
    """The intN encode on `device` (on CUDA: pipeline/int_encode_kernel.py) against the reference (see
    kernel_parts_are_the_reference); the body of the GPU test below."""
    big, tied = heavy_rows(), tied_rows()
    for encoding, n in INT_BITS.items():
        kernel_parts_are_the_reference(tied, n, encode(tied.to(device), encoding))  # hidden 128
        parts = encode(big.to(device), encoding)
        kernel_parts_are_the_reference(big, n, parts)
        # decoded: the outliers exact, the rest as accurate as the CPU's encode (which may zero another of equal
        # magnitudes: the rows of ties)
        y, y_cpu = decode(parts, encoding, torch.float32).cpu(), decode(encode(big, encoding), encoding, torch.float32)
        top = ((parts["outliers"].cpu() >> 16) & 0xFFFF).long()
        assert torch.equal(y.gather(-1, top), big.float().gather(-1, top))
        assert rel(y, big.float()) < 1.01 * rel(y_cpu, big.float()) + 1e-6, encoding
    parts = encode(big.to(device), "int5+int8last")  # layer slices of a contiguous [T, L, H]
    kernel_parts_are_the_reference(big[:, :-1], 5, parts)
    kernel_parts_are_the_reference(big[:, -1:], 8, {k[len(LAST):]: v for k, v in parts.items() if k.startswith(LAST)})
    on = big.to(device)
    noise = 1 + 1e-3 * torch.randn(big.shape, generator=torch.Generator().manual_seed(6))
    for x in (on.transpose(0, 1).contiguous().transpose(0, 1),  # rows of two strides
              torch.stack([on, on], -1).flatten(-2)[..., ::2],  # channels of stride 2
              on.reshape(8, -1, 5, 5120)[:, 1:],  # [B, S, L, H], a slice
              (big.float() * noise).to(device)):  # fp32 values that bf16 does not hold
        kernel_parts_are_the_reference(x, 4, encode(x, "int4"))


@pytest.mark.gpu
def test_the_triton_int_encode_equals_the_reference_at_its_own_channels():
    """pipeline/int_encode_kernel.py (encode's intN on CUDA) on 27B-shaped rows with massive channels, rows of ties,
    zero rows, hidden 128, every N, a mixed encoding and non-contiguous and fp32 inputs: the reference's bytes at the
    kernel's outlier channels, which are the largest |x| with the lowest channel first among ties."""
    from pipeline import encoding, int_encode_kernel

    assert (int_encode_kernel.GROUP, int_encode_kernel.OUTLIERS) == (encoding.GROUP, encoding.OUTLIERS)
    assert (int_encode_kernel.FP16_TINY, int_encode_kernel.FP16_MAX) == (encoding._FP16_TINY, encoding._FP16_MAX)
    check_int_kernel("cuda")
