"""How width enters the initialisation, the learning rates and the forward pass:
`model.parametrization` = standard | mup.

standard: every matrix is drawn with std σ (`model.init_method.std`), norm weights are ones, every
parameter trains with the scheduled rate η, and the forward pass has no multipliers.

mup, the maximal update parametrization for Adam (Yang et al. 2022, "Tensor Programs V", the
formulation with multipliers), with the width multiplier m = hidden_size / model.mup.base_width:
- hidden matrices (the attention and MLP projections, whose two dimensions both grow with the width):
  init std σ/√m, learning rate η/m, weight decay λ·m: torch's AdamW decays a weight by lr·wd each step, so
  λ·m keeps that decay, (η/m)·(λ·m) = η·λ, the same at every width (as Microsoft's mup package does in
  MuAdamW with its default decoupled_wd=False; with λ unscaled the regularisation would weaken m-fold);
- the embedding and the LM head (one dimension is the vocabulary, which does not grow): init std σ,
  learning rate η; the logits are multiplied by 1/m. The output layer keeps its init (rather than
  starting at zero) so that a tied embedding, which is also the input layer, obeys the same rule:
  a tied LM head is the embedding and follows the embedding's rules, the 1/m on the logits included;
- a mixture of experts' router (hidden size in, the number of experts out, which does not grow) is an output
  layer like the LM head: init std σ, learning rate η, its logits multiplied by 1/m; its experts are hidden
  matrices (their width should grow with the hidden size, as the dense MLP's does);
- norm weights: ones, learning rate η;
- attention scores α·q·k / d_head instead of q·k / √d_head, α = model.mup.attention_multiplier (1 by
  default). What µP fixes is the 1/d_head law (as the head dimension grows, q and k become correlated
  and their dot product grows like d_head, not √d_head); α is a constant: α = √d_head makes µP equal the
  standard parametrization at the base width when a sweep keeps d_head fixed.
m comes from the global hidden size, so no tp or pp layout changes it. At m = 1 µP is the standard
parametrization except for the attention scale (not even that when α = √d_head).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nanoexp.model.llama import EMBEDDING, LM_HEAD

ROUTER = ".mlp.router.weight"   # a MoE layer's router: an output layer under µP

# The optimizer's parameter groups, in this order (empty ones are left out): matrices trained with η
# (under µP only the embedding and the LM head), hidden matrices (µP only: η/m), vectors (no decay).
GROUPS = ("matrices", "hidden", "vectors")


@dataclass(frozen=True)
class Parametrization:
    mup: bool = False
    width_multiplier: float = 1.0   # m = hidden_size / base_width (1 under standard)
    attention_multiplier: float = 1.0   # α in α·q·k / d_head (µP only)

    def group(self, name: str, ndim: int) -> str:
        """The optimizer group of a parameter, named by the values it holds (see placement.value_name)."""
        if ndim < 2:
            return "vectors"
        output_like = name in (EMBEDDING, LM_HEAD) or name.endswith(ROUTER)
        return "hidden" if self.mup and not output_like else "matrices"

    def lr_scale(self, group: str) -> float:
        """The group's learning rate over the scheduled one."""
        return 1.0 / self.width_multiplier if group == "hidden" else 1.0

    def weight_decay(self, group: str, weight_decay: float) -> float:
        """The group's weight decay, from optimizer.weight_decay: none on vectors (norm weights), times m on
        the hidden matrices (so that lr·wd does not depend on the width, see the module docstring)."""
        if group == "vectors":
            return 0.0
        return weight_decay * self.width_multiplier if group == "hidden" else weight_decay

    def init_std(self, name: str, ndim: int, std: float) -> float:
        """The std a matrix is drawn with (vectors are norm weights: ones)."""
        return std / math.sqrt(self.width_multiplier) if self.group(name, ndim) == "hidden" else std

    def attention_scale(self, head_dim: int) -> float | None:
        """The factor on q·k; None: scaled_dot_product_attention's default 1/√head_dim."""
        return self.attention_multiplier / head_dim if self.mup else None

    @property
    def logit_multiplier(self) -> float:
        return 1.0 / self.width_multiplier if self.mup else 1.0


STANDARD = Parametrization()


def parametrization_of(cfg: Any) -> Parametrization:
    """The config's parametrization (a checkpoint written before µP existed has no key: standard)."""
    model = cfg.model
    if model.get("parametrization", "standard") != "mup":
        return STANDARD
    return Parametrization(mup=True, width_multiplier=model.model_config.hidden_size / model.mup.base_width,
                           attention_multiplier=model.mup.get("attention_multiplier", 1.0))


def describe(p: Parametrization, hidden_size: int, head_dim: int) -> str:
    """One line for the console: what the multipliers are."""
    if not p.mup:
        return "standard (one learning rate, init std for every matrix, attention 1/sqrt(d_head))"
    m = p.width_multiplier
    return (f"mup, width multiplier m = {hidden_size} / {hidden_size / m:g} = {m:g}: hidden matrices init std/sqrt(m) "
            f"and lr/m, logits x 1/m = {p.logit_multiplier:.4g}, attention {p.attention_multiplier:g}/d_head = "
            f"{p.attention_multiplier:g}/{head_dim}")
