"""benchmarks/bench_fsdp.py without running it: arguments, configs, the failure report and the table (no timing)."""
from benchmarks.bench_fsdp import config_for, format_table, parse_args, summarize, where_it_failed


def test_defaults_and_overrides():
    args = parse_args([])
    assert (args.model, args.dps, args.zero_stage, args.prefetch, args.reshard, args.exact_memory) == \
        ("small", [2, 4], 3, 1, True, True)
    args = parse_args(["--model", "tiny", "--dps", "2", "--zero-stage", "1", "--no-reshard-after-forward",
                       "tokens.micro_batch_size=2"])
    assert (args.dps, args.zero_stage, args.reshard, args.overrides) == ([2], 1, False, ["tokens.micro_batch_size=2"])


def test_fsdp2_side_is_configured_without_nanoexp_sharding():
    args = parse_args(["--model", "tiny", "--zero-stage", "1"])
    fsdp2, nanoexp = config_for(args, "fsdp2", 4), config_for(args, "nanoexp", 4)
    assert (fsdp2.parallelism.dp, fsdp2.optimizer.zero_stage) == (4, 0)
    assert (nanoexp.parallelism.dp, nanoexp.optimizer.zero_stage) == (4, 1)
    assert fsdp2.model == nanoexp.model and fsdp2.tokens == nanoexp.tokens


def test_failure_names_the_call_in_the_script():
    def shard():
        detail = "no backend for cpu\n" + "second line"
        raise RuntimeError(detail)
    try:
        shard()
    except RuntimeError as error:
        text = where_it_failed(error)
    # raised outside the script: the innermost frame of the traceback is named; the message's first line only
    assert text.startswith("RuntimeError: no backend for cpu [at test_bench_fsdp.py:")
    assert "`raise RuntimeError(detail)`" in text and text.endswith(" shard]") and "second line" not in text


def test_table_compares_nanoexp_with_fsdp2_and_shows_failures():
    run = {"tokens_s": 1000.0, "loss": 3.5, "first_loss": 5.5, "peak_mb": 100.0, "cpu_s": 2.0, "flops_per_token": 1e8}
    rows = {("fsdp2", 2): summarize([run, {**run, "tokens_s": 3000.0}], 0.1, gpus=False, dp=2),
            ("nanoexp", 2): summarize([{**run, "tokens_s": 4000.0, "loss": 3.5 + 2e-6}], 0.1, gpus=False, dp=2),
            ("fsdp2", 4): summarize([{"error": "rank 0: TypeError: boom"}, run], 0.1, gpus=False, dp=4),
            ("nanoexp", 4): summarize([run], 0.1, gpus=True, dp=4)}
    assert rows[("fsdp2", 2)]["tokens_s"] == 2000.0                 # the median of the repeats
    assert abs(rows[("nanoexp", 2)]["mfu"] - 4.0) < 1e-9             # 1e8 x 4000 / 0.1e12: one node on CPU
    assert abs(rows[("nanoexp", 4)]["mfu"] - 0.25) < 1e-9            # x dp GPUs
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["impl", "dp", "tokens/s"]
    assert lines[1].split()[:5] == ["fsdp2", "2", "2,000", "(1,000-3,000)", "200.00%"]
    assert lines[1].split()[-2:] == ["-", "-"]
    assert lines[2].split()[:3] == ["nanoexp", "2", "4,000"] and lines[2].split()[-2:] == ["2.00x", "+2.00e-06"]
    assert lines[3] == "fsdp2      4 FAILED: rank 0: TypeError: boom"
    assert lines[4].split()[-2:] == ["-", "-"]                       # no FSDP2 result to compare with
