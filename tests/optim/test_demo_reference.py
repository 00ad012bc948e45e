"""DeMo in its exact mode against a transcription of the reference implementation.

`ReferenceDeMo` below follows bloc97/DeMo's arithmetic (docs/design.md, "DeMo's reference implementation"): decay the
buffer, add lr * grad, chunk by the largest divisor <= 64, 2-D DCT per chunk by einsum,
top-k per chunk, decompress by scatter_reduce(mean), subtract what was sent, and step
p -= lr * sign(decoded mean). It is written from that description, independently of
thinwire's chunking, transform and wire code; the shapes are ones where both chunk alike.
"""

import math

import pytest
import torch

import thinwire


def ref_dct_basis(n: int) -> torch.Tensor:
    """f[i, k] = DCT-II(e_i)[k] (ortho): what the reference gets from _dct(eye(n), 'ortho')."""
    i = torch.arange(n, dtype=torch.float64)[:, None]
    k = torch.arange(n, dtype=torch.float64)[None, :]
    f = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    f[:, 0] /= math.sqrt(2.0)
    return f.float()


def ref_chunk(n: int, target: int = 64) -> int:
    return max(d for d in range(1, min(n, target) + 1) if n % d == 0)


class ReferenceDeMo:
    def __init__(self, params, lr, decay, topk, weight_decay):
        self.params, self.lr, self.decay, self.topk, self.wd = params, lr, decay, topk, weight_decay
        self.delta = [torch.zeros_like(p) for p in params]

    def encode(self, x):
        if x.dim() == 1:
            w = ref_chunk(x.shape[0])
            return torch.einsum("...ij,jb->...ib", x.view(-1, w), ref_dct_basis(w))
        h, w = ref_chunk(x.shape[0]), ref_chunk(x.shape[1])
        blocks = x.view(x.shape[0] // h, h, x.shape[1] // w, w)                 # (y h) (x w) -> y h x w
        return torch.einsum("...ijkl,jb,ld->...ikbd", blocks, ref_dct_basis(h), ref_dct_basis(w))

    def decode(self, coeffs, shape):
        if len(shape) == 1:
            return torch.einsum("...ij,jb->...ib", coeffs, ref_dct_basis(coeffs.shape[-1]).T).reshape(shape)
        y, x, h, w = coeffs.shape
        blocks = torch.einsum("...ijkl,kb,ld->...ijbd", coeffs, ref_dct_basis(h).T, ref_dct_basis(w).T)
        return blocks.permute(0, 2, 1, 3).reshape(shape)                          # y x h w -> (y h) (x w)

    def compress(self, coeffs):
        flat = coeffs.reshape(*coeffs.shape[:-2], -1) if coeffs.dim() == 4 else coeffs
        k = min(self.topk, flat.shape[-1])
        idx = flat.abs().topk(k, dim=-1, sorted=False).indices
        return idx, flat.gather(-1, idx), coeffs.shape

    def decompress(self, idx, val, shape):
        flat_shape = (*shape[:-2], shape[-2] * shape[-1]) if len(shape) == 4 else shape
        out = torch.zeros(flat_shape).scatter_reduce(-1, idx, val, reduce="mean", include_self=False)
        return out.view(shape)

    @torch.no_grad()
    def step(self):
        for p, delta in zip(self.params, self.delta):
            p.mul_(1.0 - self.lr * self.wd)
            delta.mul_(self.decay).add_(p.grad, alpha=self.lr)
            idx, val, shape = self.compress(self.encode(delta))
            delta.sub_(self.decode(self.decompress(idx, val, shape), p.shape))
            new_grad = self.decode(self.decompress(idx, val, shape), p.shape)  # one worker: gather = own
            p.add_(new_grad.sign(), alpha=-self.lr)


SHAPES = [(64, 96), (128,), (40, 200), (32, 64)]


def ref_image(coeffs: torch.Tensor) -> torch.Tensor:
    """The reference's chunk coefficients placed where their chunks lie in the matrix
    (thinwire's image layout): [y, x, h, w] -> [(y h), (x w)]; 1-D [n/w, w] -> [1, n]."""
    if coeffs.dim() == 4:
        y, x, h, w = coeffs.shape
        return coeffs.permute(0, 2, 1, 3).reshape(y * h, x * w)
    return coeffs.reshape(1, -1)


@pytest.mark.parametrize("topk, domain", [(1, "param"), (8, "param"), (32, "param"), (8, "transform")])
def test_exact_mode_matches_reference_step_for_step(topk, domain):
    """domain='transform' keeps T(M) instead of M: the same algorithm (T is linear), so it
    must follow the reference too, its momentum equal to the reference's buffer transformed."""
    torch.manual_seed(0)
    ours = [torch.randn(s, requires_grad=True) for s in SHAPES]
    theirs = [p.detach().clone().requires_grad_(True) for p in ours]
    targets = [torch.randn(s) for s in SHAPES]
    opt = thinwire.DeMo(ours, lr=0.01, beta=0.999, alpha=1.0, topk=topk, chunk=64, transform="dct",
                        base="signum", values="fp32", weight_decay=0.1, momentum_domain=domain,
                        momentum_form="reference")
    ref = ReferenceDeMo(theirs, lr=0.01, decay=0.999, topk=topk, weight_decay=0.1)
    for step in range(30):
        noise = [torch.randn(s) for s in SHAPES]
        for params in (ours, theirs):
            loss = sum(((p - t) ** 2).sum() + (p * n).sum() for p, t, n in zip(params, targets, noise))
            loss.backward()
        opt.step()
        ref.step()
        for p, q, delta in zip(ours, theirs, ref.delta):
            # Same equations; einsum and matmul may round differently in the last bit.
            assert torch.allclose(p, q, rtol=0, atol=1e-6), f"step {step}: params differ"
            expected = delta if domain == "param" else ref_image(ref.encode(delta))
            err = (opt.state[p]["momentum"] - expected).abs().max().item()
            assert err <= 2e-6, f"step {step}: momentum differs by {err}"
            p.grad = None
            q.grad = None
