"""Bad configurations and command lines: each is rejected at start-up, before any process group
or training work, with a non-zero exit and a short message that names the key.

The table drives `train.py`'s real entry point in-process (Hydra parses the command line exactly as
in a shell), which keeps ~30 cases fast. README.md's "What is guarded" table lists the same cases.
"""
import os
import sys
from unittest import mock

import pytest

import train

T = "optimizer.learning_rate_scheduler."
M = "model.model_config."
A = "optimizer.optimizer_factory."
S, E = "{name: ", ", data: {}}"   # a data stage's opening and its (empty) data
# (id, command-line overrides, extra environment, text the message must contain)
CASES = [
    ("unknown key", [M + "hiden_size=64"], {}, "hiden_size"),
    ("unknown section", ["trainer.steps=3"], {}, "trainer"),
    ("wrong type int", ["tokens.micro_batch_size=four"], {}, "micro_batch_size"),
    ("wrong type float", [T + "learning_rate=fast"], {}, "learning_rate"),
    ("zero micro batch", ["tokens.micro_batch_size=0"], {}, "tokens.micro_batch_size=0"),
    ("negative steps", ["tokens.train_steps=-5"], {}, "tokens.train_steps=-5"),
    ("zero sequence", ["tokens.sequence_length=0"], {}, "tokens.sequence_length=0"),
    ("zero dp", ["parallelism.dp=0"], {}, "parallelism.dp=0"),
    ("unknown start method", ["parallelism.start_method=thread"], {}, "parallelism.start_method=thread"),
    ("heads do not divide hidden", [M + "num_attention_heads=5", M + "num_key_value_heads=5"], {},
     "hidden_size=96 is not divisible by num_attention_heads=5"),
    ("kv heads do not divide heads", [M + "num_key_value_heads=3"], {}, "num_key_value_heads=3"),
    ("odd head dim", [M + "hidden_size=100"], {}, "head dimension must be even"),
    ("dp*cp*tp*pp != world size", [], {"RANK": "0", "WORLD_SIZE": "3"}, "world size is 3"),
    ("heads not divisible by tp", ["parallelism.tp=3"], {}, "num_attention_heads=4 is not divisible by parallelism.tp=3"),
    ("kv heads not divisible by tp", [M + "num_key_value_heads=2", "parallelism.tp=4"], {},
     "num_key_value_heads=2 is not divisible by parallelism.tp=4"),
    ("vocab not divisible by tp", ["model.make_vocab_size_divisible_by=1", "parallelism.tp=2"], {},
     "model.make_vocab_size_divisible_by"),
    ("more stages than layers", ["parallelism.pp=8"], {}, "num_hidden_layers=4"),
    ("sequence beyond positions", ["tokens.sequence_length=4096"], {}, "max_position_embeddings"),
    ("sequence not divisible by tp under SP", ["tokens.sequence_length=127", "parallelism.tp=2",
                                              "parallelism.tp_mode=reduce_scatter"], {}, "tokens.sequence_length=127"),
    ("unknown engine", ["parallelism.pp_engine=gpipe"], {}, "parallelism.pp_engine=gpipe"),
    ("zero cp", ["parallelism.cp=0"], {}, "parallelism.cp=0"),
    ("unknown cp mode", ["parallelism.cp_mode=striped"], {},
     "parallelism.cp_mode=striped: allowed values are ring, all_gather, ulysses"),
    ("dp*cp*tp*pp != world size", ["parallelism.cp=2"], {"RANK": "0", "WORLD_SIZE": "4"},
     "parallelism.dp*cp*tp*pp = 1*2*1*1 = 2 but the world size is 4"),
    ("sequence not divisible by 2*cp", ["tokens.sequence_length=100", "parallelism.cp=4"], {},
     "tokens.sequence_length=100 is not divisible by 2 * parallelism.cp = 8"),
    ("sequence / cp not divisible by tp under SP", ["tokens.sequence_length=12", "parallelism.cp=2",
                                                    "parallelism.tp=4", "parallelism.tp_mode=reduce_scatter"], {},
     "tokens.sequence_length / parallelism.cp = 12/2 is not divisible by parallelism.tp=4"),
    ("unknown tp mode", ["parallelism.tp_mode=ring"], {}, "parallelism.tp_mode=ring"),
    ("unknown optimizer", ["optimizer.optimizer_factory.name=sgd"], {}, "optimizer.optimizer_factory.name=sgd"),
    ("muon coefficients that diverge", [A + "name=muon", A + "muon_ns_coefficients=[1e30,1e30,1e30]"], {},
     A + "muon_ns_coefficients=[1e+30, 1e+30, 1e+30]: the Newton–Schulz iteration diverges"),
    ("unknown decay style", [T + "lr_decay_style=exp"], {}, "lr_decay_style=exp"),
    ("unknown warmup style", [T + "lr_warmup_style=cubic"], {}, "lr_warmup_style=cubic"),
    ("warm-up longer than training", ["tokens.train_steps=10", T + "lr_warmup_steps=20"], {}, "lr_warmup_steps=20"),
    ("min lr above peak", [T + "min_decay_lr=1.0"], {}, "min_decay_lr"),
    ("negative clip", ["optimizer.clip_grad=-1"], {}, "optimizer.clip_grad=-1"),
    ("zero clip", ["optimizer.clip_grad=0"], {}, "optimizer.clip_grad=0.0: must be positive or null"),
    ("zero decay steps", [T + "lr_decay_steps=0"], {}, T + "lr_decay_steps=0: must be >= 1 or null"),
    ("decay starting inside warm-up", [T + "lr_decay_starting_step=5"], {},
     T + "lr_decay_starting_step=5: must be >= lr_warmup_steps=20"),
    ("negative weight decay", ["optimizer.weight_decay=-0.1"], {}, "optimizer.weight_decay=-0.1: must be >= 0"),
    ("adam beta1 of 1", [A + "adam_beta1=1"], {}, A + "adam_beta1=1.0: must be in [0, 1)"),
    ("negative adam beta2", [A + "adam_beta2=-0.5"], {}, A + "adam_beta2=-0.5: must be in [0, 1)"),
    ("zero adam eps", [A + "adam_eps=0"], {}, A + "adam_eps=0.0: must be positive"),
    ("zero init std", ["model.init_method.std=0"], {}, "model.init_method.std=0.0: must be positive"),
    ("unknown zero stage", ["optimizer.zero_stage=4"], {}, "optimizer.zero_stage=4"),
    ("negative zero3 prefetch", ["optimizer.zero3_prefetch=-1"], {}, "optimizer.zero3_prefetch=-1: must be >= 0"),
    ("zero3 prefetch below ZeRO-3", ["optimizer.zero3_prefetch=2", "optimizer.zero_stage=1"], {},
     "optimizer.zero3_prefetch=2 has no effect at optimizer.zero_stage=1"),
    ("zero3 reshard below ZeRO-3", ["optimizer.zero3_reshard_after_forward=false", "optimizer.zero_stage=2"], {},
     "optimizer.zero3_reshard_after_forward=false has no effect at optimizer.zero_stage=2"),
    ("reduce-scatter overlap below ZeRO-2", ["optimizer.zero_overlap_reduce_scatter=true"], {},
     "optimizer.zero_overlap_reduce_scatter=True has no effect at optimizer.zero_stage=0"),
    ("global batch not divisible", ["tokens.global_batch_size=30"], {}, "tokens.global_batch_size=30"),
    ("negative val batches", ["tokens.limit_val_batches=-1"], {}, "tokens.limit_val_batches=-1: must be >= 0"),
    ("tokenizer vocab above model vocab", [M + "vocab_size=200"], {}, "vocab_size=200"),
    ("tokenizer path missing", ["tokenizer.tokenizer_name_or_path=/no/such/tokenizer"], {},
     "tokenizer.tokenizer_name_or_path"),
    ("unknown dtype", ["model.dtype=float16"], {}, "model.dtype=float16"),
    ("unknown wandb mode", ["logging.wandb.mode=cloud"], {}, "logging.wandb.mode=cloud"),
    ("first data stage not at step 1", [f"data_stages=[{S}a, start_training_step: 2{E}]"], {},
     "data_stages[0].start_training_step=2: the first stage must start at step 1"),
    ("data stages not increasing", [f"data_stages=[{S}a, start_training_step: 1{E}, {S}b, start_training_step: 1{E}]"],
     {}, "data_stages[1].start_training_step=1: must be larger than data_stages[0].start_training_step=1"),
    ("data stages with one name", [f"data_stages=[{S}a, start_training_step: 1{E}, {S}a, start_training_step: 4{E}]"],
     {}, "data_stages[1].name='a': every stage needs its own non-empty name"),
    ("data stage without a name", ["data_stages=[{start_training_step: 1}]"], {},
     "data_stages[0].name=???: must be set"),
    ("data stage with an empty folder list", ["data_stages=[{name: a, start_training_step: 1, data: {name: nanoset}}]"],
     {}, "data_stages[0].data.dataset_folder is empty"),
    ("data stage folder missing", [f"data_stages=[{S}a, start_training_step: 1{E}, {S}b, start_training_step: 3, "
                                   "data: {name: nanoset, dataset_folder: [/no/such/folder]}}]"], {},
     "data_stages[1].data.dataset_folder: /no/such/folder does not exist"),
    ("unknown parametrization", ["model.parametrization=sp"], {}, "model.parametrization=sp"),
    ("mup without base width", ["model.parametrization=mup"], {}, "model.mup.base_width=None: must be a positive"),
    ("mup attention multiplier zero", ["model.parametrization=mup", "model.mup.base_width=48",
                                       "model.mup.attention_multiplier=0"], {}, "model.mup.attention_multiplier=0.0"),
    ("mup from HF weights", ["model.parametrization=mup", "model.mup.base_width=48", "model.init_method.path=/no/hf"],
     {}, "model.init_method.path=/no/hf: Hugging Face Llama weights are a standard-parametrization model"),
]


def run_cli(overrides, env, run_dir):
    """Run train.py's entry point with these overrides; return (exit code, stderr text)."""
    argv = ["train.py", *overrides, f"hydra.run.dir={run_dir}"]
    with mock.patch.object(sys, "argv", argv), mock.patch.dict(os.environ, env), \
            pytest.raises(SystemExit) as exit_info:
        train.main()
    return exit_info.value.code


@pytest.mark.parametrize("name, overrides, env, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_before_work(name, overrides, env, needle, tmp_path, capsys):
    code = run_cli(overrides, env, tmp_path / "run")
    err = capsys.readouterr().err
    assert code not in (0, None)
    assert needle in err, err
    assert "Traceback" not in err and len(err.splitlines()) <= 12   # one short message, no stack
    # Nothing was trained: no metrics, no summary, no process group.
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "summary.json").exists()


def test_at_least_25_cases():
    assert len(CASES) >= 25


def test_file_dependent_inputs_are_rejected_before_work(tmp_path, capsys):
    """The cases that need files: a missing or incompatible resume checkpoint, a dataset folder
    without metadata or with a metadata.json that is not JSON, data smaller than one batch."""
    from tests.helpers import FAST, train
    from tests.test_nanoset import write_nanoset

    train(tmp_path / "saved", FAST + ["tokens.train_steps=1", "tokens.val_check_interval=0",
                                      "optimizer.learning_rate_scheduler.lr_warmup_steps=0"])
    checkpoint = tmp_path / "saved" / "checkpoints" / "1"
    (tmp_path / "no_metadata").mkdir()
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "metadata.json").write_text("garbage\n")
    small = write_nanoset(tmp_path / "small", ["to be or not to be"] * 12)
    capsys.readouterr()   # drop what the set-up run printed (stale handlers of earlier Hydra runs)
    cases = [
        (["checkpoint.resume_checkpoint_path=/no/such/checkpoint"], "checkpoint.resume_checkpoint_path"),
        (FAST + [f"checkpoint.resume_checkpoint_path={checkpoint}", M + "hidden_size=96"],
         "model.embed_tokens.weight"),
        (["data=nanoset", f"data.dataset_folder=[{tmp_path / 'no_metadata'}]"], "metadata.json"),
        (["data=nanoset", f"data.dataset_folder=[{tmp_path / 'garbage'}]"],
         f"{tmp_path / 'garbage' / 'metadata.json'}: not valid JSON"),
        (FAST + ["data=nanoset", f"data.dataset_folder=[{small}]", "data.validation_fraction=0.3"],
         "fewer than one global batch"),
    ]
    for overrides, needle in cases:
        code = run_cli(overrides, {}, tmp_path / "run")
        err = capsys.readouterr().err
        assert code not in (0, None) and needle in err, (overrides, err)
        assert "Traceback" not in err and not (tmp_path / "run" / "metrics.jsonl").exists()
