"""Train draft heads (Medusa, EAGLE-1/2, EAGLE-3) from a YAML recipe.

``specgraft train RECIPE [key=value ...]`` trains in this process; with ``--num-processes N`` or
``--accelerate-config FILE`` it hands off to ``accelerate launch -m specgraft.train`` (what multi-GPU and
DeepSpeed users run directly).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys

from specgraft.errors import SpecgraftError
from specgraft.utils.io import output_lock
from specgraft.utils.threads import add_threads_argument, set_torch_threads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser, "recipes/medusa/, recipes/eagle/, recipes/eagle3/")


def add_job_arguments(parser: argparse.ArgumentParser, where: str) -> None:
    """The arguments every recipe job (``train``, ``distill``) takes."""
    parser.add_argument("recipe", help=f"YAML recipe (see {where}).")
    parser.add_argument("overrides", nargs="*", help="Recipe overrides key.sub=value, e.g. training.max_steps=100.")
    parser.add_argument("--resume", action="store_true",
                        help="Continue the run in output.dir from its newest good checkpoint.")
    parser.add_argument("--num-processes", type=int, default=None,
                        help="Launch this many processes (accelerate launch; torchrun on CPU-only machines).")
    parser.add_argument("--accelerate-config", default=None,
                        help="An accelerate config file (DDP, DeepSpeed, FSDP; see recipes/accelerate/).")
    parser.add_argument("--no-progress", action="store_true", help="Hide the progress bar.")
    add_threads_argument(parser)
    parser.add_argument("--dry-run", action="store_true",
                        help="Check the recipe end to end on a tiny random model of the target's architecture "
                             "(one step, nothing downloaded or written).")


def run(args: argparse.Namespace) -> int:
    from specgraft.train.trainer import HeadTrainer

    def done(recipe, trainer, summary) -> str:
        return (f"head saved to {recipe.output.dir}/head  ({summary['steps']} steps, "
                f"{summary['tokens_per_s']:.0f} target tokens/s)")

    return run_job(args, HeadTrainer, "specgraft.train", done)


#: Set for the processes :func:`_launch` starts: they run under the launcher's output-folder lock.
LAUNCHED_ENV = "SPECGRAFT_LAUNCHED"


def run_job(args: argparse.Namespace, trainer_cls: type, module: str, describe) -> int:
    """Dry-run, hand off to a multi-process launcher, or train in this process; prints ``describe(...)``."""
    from specgraft.config import load_recipe

    set_torch_threads(args.threads)  # validated before anything heavy; a launch passes it on to every process
    # fail fast, before starting anything heavy
    recipe = load_recipe(args.recipe, args.overrides, schema=trainer_cls.recipe_schema)
    if args.num_processes is not None and args.num_processes < 1:
        raise SpecgraftError(f"--num-processes must be at least 1, got {args.num_processes}")
    if args.dry_run:
        from specgraft.train.dry_run import dry_run_recipe

        summary = dry_run_recipe(recipe, trainer_cls)
        # "ok" only when nothing known will fail: a missing data file or source head (recipes are dry-run before the
        # data is downloaded, so it is no error here) makes it a partial pass, said as such.
        problems = summary.get("input_problems") or []
        verdict = "dry run passed except for its inputs" if problems else "dry run ok"
        print(f"{verdict}: {args.recipe} on a tiny random {summary['model_type']} "
              f"({summary['stand_in_layers']} layers): {summary['trainable_parameters']:,} trainable parameters, "
              f"{summary['optimizer_groups']} optimizer group(s), {summary['steps']} step")
        for problem in problems:
            print(f"WARNING: the real run will fail here: {problem}", file=sys.stderr)
        return 0
    if args.num_processes or args.accelerate_config:
        return _launch(args, module, recipe.output.dir)
    trainer = trainer_cls(recipe, resume=args.resume, show_progress=not args.no_progress)
    # One run per output folder: a second run into it fails at once instead of both "succeeding" with one lost.
    # A process started by a launcher runs under the lock its launcher (see _launch) holds.
    launched = LAUNCHED_ENV in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1
    lock = contextlib.nullcontext() if launched else output_lock(recipe.output.dir, f"`specgraft {trainer.command}`")
    trainer.check_output_dir()  # before the lock: a refused folder gets no lock file
    try:
        with lock:
            trainer.setup()
            summary = trainer.train()
    finally:
        trainer.cleanup()
    if trainer.accelerator.is_main_process:
        print(describe(recipe, trainer, summary))
    return 0


def launcher_command(module: str, num_processes: int | None, accelerate_config: str | None) -> list[str]:
    """The command that starts ``python -m module`` once per process.

    ``accelerate launch`` on machines with accelerators (or with an accelerate config); ``torchrun`` for plain
    multi-process CPU jobs, which accelerate's own launcher would run as a single process without MPI.
    """
    import torch

    def tool(name: str) -> str:
        return shutil.which(name) or os.path.join(os.path.dirname(sys.executable), name)

    has_accelerator = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    if accelerate_config or has_accelerator:
        cmd = [tool("accelerate"), "launch"]
        if accelerate_config:
            cmd += ["--config_file", accelerate_config]
        if num_processes:
            cmd += ["--num_processes", str(num_processes)]
        return [*cmd, "-m", module]
    return [tool("torchrun"), "--nproc_per_node", str(num_processes or 1), "-m", module]


def _launch(args: argparse.Namespace, module: str, output_dir: str) -> int:
    """Re-run this job once per process (see :func:`launcher_command`)."""
    cmd = launcher_command(module, args.num_processes, args.accelerate_config)
    cmd += [args.recipe, *args.overrides]
    if args.resume:
        cmd.append("--resume")
    if args.no_progress:
        cmd.append("--no-progress")
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    print("launching:", " ".join(cmd), file=sys.stderr)
    with output_lock(output_dir, f"`specgraft {module.rsplit('.', 1)[-1]}`"):
        return subprocess.call(cmd, env={**os.environ, LAUNCHED_ENV: "1"})
