"""How width enters the initialisation, the learning rates and the forward pass (`model.parametrization`):
standard (std σ everywhere, one rate η, no multipliers) or mup, the maximal update parametrization for Adam (Yang
et al. 2022, "Tensor Programs V", with multipliers) at width multiplier m = hidden_size / model.mup.base_width:
hidden matrices (experts included) init σ/√m, rate η/m, weight decay λ·m; the embedding, the LM head and a MoE
router keep σ and η, and their logits are multiplied by 1/m; attention scores α·q·k/d_head. m comes from the
global hidden size, so no layout changes it. The rules, their reasons and the µTransfer measurements: docs/mup.md."""
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
    hidden_lr_scale: float | None = None   # the optimizer's own rate on hidden matrices (None: AdamW's 1/m)

    def group(self, name: str, ndim: int) -> str:
        """The optimizer group of a parameter, named by the values it holds (see placement.value_name)."""
        if ndim < 2:
            return "vectors"
        output_like = name in (EMBEDDING, LM_HEAD) or name.endswith(ROUTER)
        return "hidden" if self.mup and not output_like else "matrices"

    def lr_scale(self, group: str) -> float:
        """The group's learning rate over the scheduled one. Hidden matrices: AdamW's update moves every entry by
        about lr, its spectral norm grows as m: 1/m; another optimizer's update grows as it says (its OPTIMIZERS
        entry's hidden_lr_scale, optim/registry.py: Muon's, optim/muon.py)."""
        if group != "hidden":
            return 1.0
        return 1.0 / self.width_multiplier if self.hidden_lr_scale is None else self.hidden_lr_scale

    def weight_decay(self, group: str, weight_decay: float) -> float:
        """The group's weight decay, from optimizer.weight_decay: none on vectors (norm weights), over the lr
        scale on the hidden matrices (so that lr·wd does not depend on the width, see the module docstring)."""
        if group == "vectors":
            return 0.0
        if group != "hidden":
            return weight_decay
        return weight_decay * self.width_multiplier if self.hidden_lr_scale is None else \
            weight_decay / self.lr_scale(group)

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
    """The config's parametrization (a checkpoint written before µP existed has no key: standard), with AdamW's
    rate on the hidden matrices: optim/registry.py's optimizer_parametrization gives the configured optimizer's."""
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
