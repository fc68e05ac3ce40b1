"""Few-row matmuls on the CPU: y = (W @ x^T)^T for 2..MAX_ROWS rows of float32.

Verification feeds the target 1 + K tokens a request, and on the CPU F.linear (x @ W^T) is slow
for such skinny inputs: on this workplace's 2-core AMD EPYC (torch 2.13, oneDNN) a 4-row product
with SmolLM2-135M's 49152 x 576 lm_head took ~20 ms against ~8 ms for one row, and the model's
other layers ~1.6x their one-row time. The same product as W @ x^T (W the left operand, the few
rows the narrow right one) took ~8 ms, and fixed K = 3 on copy prompts at batch 1 went from
1.06x plain decoding's tokens/s to 1.65x (`benchmarks/RESULTS.md`, 2026-12-07 fourth entry).
The result is copied back to row-major: a transposed view fed to the next layer's W @ x^T turns
its right operand into a plain matrix, which oneDNN multiplies as slowly as F.linear.

Up to 32 rows, so that batch-6 verification (24 rows) takes it as batch-6 plain decoding (6
rows) does: with 8, plain decoding gained more than drafting and two sampled batch-6 cells of
`benchmarks/never_slower_cpu.py` fell to 0.88-0.89x plain (0.92-0.94x with 32). One row stays
F.linear (a matrix-vector product, as fast either way), and so do longer prompt chunks,
float16 / bfloat16 and anything that needs gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.ops.linear_swap import replace_linears_, sharing

MAX_ROWS = 32


def takes(x: torch.Tensor) -> bool:
    """Whether `x` ([..., K]) is a few float32 CPU rows that W @ x^T serves better."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return (
        not x.is_cuda
        and x.dtype == torch.float32
        and 2 <= rows <= MAX_ROWS
        and not torch.is_grad_enabled()
    )


def skinny_linear(
    # [..., K]
    x: torch.Tensor,
    # [N, K]
    w: torch.Tensor,
    # [N] or None
    b: torch.Tensor | None,
) -> torch.Tensor:
    """[..., N] = F.linear(x, w, b), as W @ x^T copied back to row-major."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.mm(w, x2.t()).t().contiguous()
    if b is not None:
        y += b
    return y.view(*x.shape[:-1], w.shape[0])


class CpuLinear(nn.Linear):
    """nn.Linear whose few-row float32 CPU calls run `skinny_linear`; the rest F.linear."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> CpuLinear:
        """A CpuLinear over `linear`'s own Parameter objects and markers (no copy)."""
        return sharing(cls, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes(x):
            return skinny_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_cpu_linear_(model: nn.Module) -> int:
    """Replace every plain nn.Linear child of `model` by a CpuLinear holding the same
    parameters (and markers); returns how many."""
    return replace_linears_(model, CpuLinear.sharing)
