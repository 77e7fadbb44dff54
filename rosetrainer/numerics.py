"""When two float32 runs of the one model count as the same computation.

Every cached path (a concatenated or static cache, a padded batch, the paged engine, an
ONNX graph, a split model) does the oracle's arithmetic in another order: a decode query
alone instead of one row of the full attention matrix, a softmax over a masked buffer,
a matrix-vector product instead of a matrix-matrix one. Floating-point addition is not
associative, so their logits agree with the oracle's only up to rounding. How the rounding
falls also depends on the machine: PyTorch picks its CPU kernels by what the processor
offers (AVX-512 or AVX2, oneDNN or not), and each sums in its own order.

One float32 operation is exact to a relative 2**-24. A logit is the end of a chain of sums
(about 15 per layer: layer norms, attention, the MLP) whose terms are as large as the
activations, so the rounding that reaches it grows with the largest values of the step,
not with the logit itself. The bound is therefore relative to the step's largest logit:

    |got - want| <= LOGIT_RTOL * max(1, max |want|)      at every step, every vocabulary entry

LOGIT_RTOL is 2**-16 (about 1.5e-5, 128 float32 epsilons). The gaps measured between the
uncached run and every cached, batched, paged, exported and split path of the test models
(logits up to about 15) stay under 5% of it on an AVX-512 and on an AVX2 kernel path
(ATEN_CPU_CAPABILITY=avx2); two separate implementations of GPT-2 (rose and transformers)
use a third of it. Every known bug the chapters show moves the logits by 0.1 or more, three to
four orders of magnitude past it. Tokens are compared exactly, always: the tolerance only
ever applies to logits, and a greedy step whose top-1 beats the second by less than twice
the tolerance is a near-tie that no test may build on (rounding could swap the two).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT32_EPS = torch.finfo(torch.float32).eps  # 2**-23: the gap between 1.0 and the next float32
LOGIT_RTOL = 128 * FLOAT32_EPS  # 2**-16 ~ 1.5e-5 (why this much: see above)


def logit_tolerance(reference: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """The largest logit difference allowed against `reference` (one step's logits, or a
    run's steps: then the largest step sets the scale)."""
    if isinstance(reference, torch.Tensor):
        scale = float(reference.detach().abs().max())
    else:
        scale = max(float(step.detach().abs().max()) for step in reference)
    return LOGIT_RTOL * max(1.0, scale)
