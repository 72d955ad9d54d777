"""The optimizer's parameter groups of a config as a table (what `scripts/make_config.py --show-lrs` prints): each
group's tensors, init std, learning rate (peak and end of decay) and weight decay, read from the model's full
shapes with the optimizer's own grouping rule, so nothing is built and any model size answers at once."""
from __future__ import annotations

import math
import re

from nanoexp.model.llama import parameter_shapes
from nanoexp.model.mup import GROUPS, describe
from nanoexp.config import optimizer_name
from nanoexp.model.shape import model_shape
from nanoexp.optim.registry import OPTIMIZERS, optimizer_parametrization
from nanoexp.optim.schedule import min_decay_lr


def lr_table(cfg) -> str:
    """The parametrization, then one line per parameter group of the (normalized, valid) config `cfg`."""
    shape, mup, sched = model_shape(cfg), optimizer_parametrization(cfg), cfg.optimizer.learning_rate_scheduler
    entry = OPTIMIZERS[optimizer_name(cfg)]
    members: dict[tuple[str, str], list] = {}
    for name, full in parameter_shapes(shape).items():
        optimizer = entry.updater(cfg, name, len(full))
        members.setdefault((mup.group(name, len(full)), optimizer), []).append((name, full))
    lines = [f"parametrization: {describe(mup, shape.hidden_size, shape.head_dim)}",
             f"{'group':<10}{'optimizer':>10}{'tensors':>8}{'parameters':>12}{'init std':>10}{'lr scale':>10}"
             f"{'peak lr':>11}{'final lr':>11}{'decay':>7}  holds"]
    for group, optimizer in sorted(members, key=lambda key: (GROUPS.index(key[0]), key[1])):
        rows = members[group, optimizer]
        name, full = rows[0]
        std = "ones" if group == "vectors" else f"{mup.init_std(name, len(full), cfg.model.init_method.std):.4g}"
        scale = mup.lr_scale(group)
        decay = mup.weight_decay(group, cfg.optimizer.weight_decay)
        held = dict.fromkeys(re.sub(r"^model\.layers\.\d+\.", "", n).removesuffix(".weight") for n, _ in rows)
        held = [n for n in held if n.startswith(("model.", "lm_head"))] + [   # the layers' tensors in one entry
            "model.layers.*.{" + ", ".join(n for n in held if not n.startswith(("model.", "lm_head"))) + "}"]
        parameters = sum(math.prod(f) for _, f in rows)
        lines.append(f"{group:<10}{optimizer:>10}{len(rows):>8}{parameters:>12,}{std:>10}{scale:>10.4g}"
                     f"{sched.learning_rate * scale:>11.4g}{min_decay_lr(cfg) * scale:>11.4g}{decay:>7g}  "
                     + ", ".join(n for n in held if not n.endswith("{}"))
                     + (" (= lm_head, tied)" if shape.tie_word_embeddings and "model.embed_tokens" in held else ""))
    return "\n".join(lines + entry.lr_notes(cfg))
