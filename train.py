"""nanoexp's entry point: Hydra composes conf/ into one config, nanoexp validates and launches it.

    python train.py                                  # tiny Llama, built-in corpus, one process
    python train.py parallelism=dp2tp2pp2            # 8 local processes (or under torchrun/SLURM)
    python train.py -m parallelism=dp2tp1pp1,dp1tp2pp1 optimizer.learning_rate_scheduler.learning_rate=1e-3,3e-4
"""
import os
import sys

from nanoexp.launch.signals import stop_during_start_up   # the standard library only

if __name__ == "__main__":
    stop_during_start_up()   # SIGINT/SIGTERM from here to the first step end the run at once: one line, exit 130/143

# After that line on purpose: these imports (torch among them) take seconds.
import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from nanoexp.config import register_configs
from nanoexp.parallel.context import launcher_env

register_configs()


def quiet_nonzero_ranks() -> None:
    """Under torchrun every rank composes the config; only rank 0 may make a run folder (Hydra
    names it by the clock, so ranks would disagree). The others learn rank 0's folder later."""
    env = launcher_env()
    if env and env["rank"] != 0 and "-m" not in sys.argv and "--multirun" not in sys.argv:
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null",
                     "hydra/job_logging=none", "hydra/hydra_logging=none"]


def slurm_launcher(hydra_cfg) -> dict | None:
    """hydra.launcher, resolved, when this job is one of hydra/launcher=slurm's (replica groups submit theirs)."""
    if not str(hydra_cfg.launcher.get("_target_", "")).endswith(".NanoexpSlurmLauncher"):
        return None
    return OmegaConf.to_container(hydra_cfg.launcher, resolve=True)


@hydra.main(version_base="1.3", config_path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf"),
            config_name="config")
def main(cfg) -> None:
    from nanoexp.launch.hydra_callbacks import created_for_run
    from nanoexp.run import HydraJob, main as run_main
    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    job = HydraJob(overrides=list(hydra_cfg.overrides.task), override_dirname=hydra_cfg.job.override_dirname,
                   sweep_dir=hydra_cfg.sweep.dir if multirun else None,
                   created_folder=None if multirun else created_for_run(run_dir),
                   slurm_launcher=slurm_launcher(hydra_cfg) if multirun else None)
    run_main(cfg, run_dir, job)


if __name__ == "__main__":
    quiet_nonzero_ranks()
    main()
