"""The whole staleness study in one command, run as stages (issue #19).

Every loss at staleness 0, 8, 64 and 256 with 3 seeds, 6 for the close candidates, plus log-normal
delays, prime-rl's drop-older-than-8 at 64 and a gradient-clipping check, is about 6 hours of
single-thread run time: 3 hours on two cores. So it runs as stages of at most about an hour, each an ordinary
`python -m benchmarks.staleness` study in its own directory under --out, in order:

    python -m benchmarks.staleness_stages                # every stage not finished yet, then the combined report
    python -m benchmarks.staleness_stages --list         # the stages, their runs, and which are done
    python -m benchmarks.staleness_stages --only NAME,.. # these stages (combined once every uniform one is done)
    python -m benchmarks.staleness_stages --quick        # the quick study alone (a few minutes), into --out/quick
    python -m benchmarks.staleness_stages --plan FILE    # another plan: YAML, `stages:` a list of Stage fields

Stop it at any time and give the same command again: a finished stage (its staleness.json exists)
is skipped, an interrupted one resumes from its finished runs (`--resume`). The uniform-delay stages
are combined into --out/combined (`python -m benchmarks.staleness --combine`); the log-normal and
drop-older-than stages report on their own. Options not named here (--workers, --steps, ...) go to
every stage's study unchanged, so that all stages train alike and combine.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from benchmarks import staleness
from benchmarks.common import RESULTS

GEPO_FIXED = "gepo[gepo_clip=weight+token-neg]"  # GEPO's default clip since this study; "gepo" is the paper's
EVERY_LOSS = ",".join([*staleness.ALL_LOSSES, GEPO_FIXED])
CLOSE = f"topr,gepo,{GEPO_FIXED}"


class Stage(BaseModel):
    """One stage: a staleness study of these losses, levels and seeds in --out/NAME."""

    model_config = ConfigDict(extra="forbid")
    name: str
    losses: str
    staleness: str
    seeds: int = 3
    first_seed: int = 0
    delay_shape: str = "uniform"
    drop_older_than: Optional[int] = None
    # into the combined report: by default the stages with the study's own delays (uniform, nothing dropped)
    combine: Optional[bool] = None
    why: str = ""

    @model_validator(mode="after")
    def _defaults(self):
        if not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"stage name {self.name!r}: letters, digits, '_' and '-' only (it names a directory)")
        if self.combine is None:
            self.combine = self.delay_shape == "uniform" and self.drop_older_than is None
        return self

    def study_args(self) -> list[str]:
        args = ["--losses", self.losses, "--staleness", self.staleness, "--seeds", str(self.seeds),
                "--first-seed", str(self.first_seed), "--delay-shape", self.delay_shape]
        return args + (["--drop-older-than", str(self.drop_older_than)] if self.drop_older_than is not None else [])

    def runs(self) -> int:
        return len(staleness.split_losses(self.losses)) * len(self.staleness.split(",")) * self.seeds


# The plan that produced benchmarks/results/staleness_stages/. The close candidates of stages 3-5
# were chosen from stages 1-2: the losses within a seed's spread of the best at a level.
PLAN = [
    Stage(name="every_loss_at_0_and_8", losses=EVERY_LOSS, staleness="0,8", why="every loss, 3 seeds"),
    Stage(name="every_loss_at_64_and_256", losses=EVERY_LOSS, staleness="64,256", why="every loss, 3 seeds"),
    Stage(name="close_seeds_3_5", losses=CLOSE, staleness="0,8,64", first_seed=3,
          why="seeds 3-5 for the close candidates at 0, 8 and 64"),
    Stage(name="close_at_8_seeds_3_5", losses="grpo,gmpo,m2po", staleness="8", first_seed=3,
          why="seeds 3-5 for the others close at 8"),
    Stage(name="close_at_64_seeds_3_5", losses="gmpo,m2po,cispo", staleness="64", first_seed=3,
          why="seeds 3-5 for the others close at 64"),
    Stage(name="close_at_256_seeds_3_5", losses=CLOSE, staleness="256", first_seed=3,
          why="seeds 3-5 for the close candidates at 256"),
    Stage(name="lognormal_at64", losses=f"topr,gepo,{GEPO_FIXED},grpo,cispo,m2po", staleness="64",
          delay_shape="lognormal", why="the paper's log-normal delay shape at 64"),
    Stage(name="drop_older_than_8_at64", losses=f"grpo,gepo,{GEPO_FIXED},topr", staleness="64",
          drop_older_than=8, why="prime-rl's rule: groups more than 8 steps old dropped"),
    # TOPR's summed log-probs put its gradient norm at 5-7, so every step of it is clipped to
    # max_grad_norm 1; is that, rather than its weight, why it wins? TOPR unclipped, and GEPO fixed
    # clipped on every step (its median norm is about 0.5).
    Stage(name="clipping_check_at_0_and_64", losses="topr[max_grad_norm=0],gepo[gepo_clip=weight+token-neg;max_grad_norm=0.1]",
          staleness="0,64", combine=False, why="does gradient clipping on every step explain TOPR?"),
]


def read_plan(path: Path) -> list[Stage]:
    """A plan file: YAML with `stages:`, a list of Stage fields. Raises ValueError naming what is wrong."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read the plan {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("stages"), list) or not data["stages"]:
        raise ValueError(f"{path}: a plan is a mapping with `stages:`, a non-empty list of stages")
    stages = []
    for i, entry in enumerate(data["stages"]):
        try:
            stages.append(Stage(**(entry if isinstance(entry, dict) else {})))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'stage'}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"{path}: stage {i + 1}: {problems}") from None
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: two stages share a name ({names}); each names its own directory")
    return stages


def stage_state(out: Path, stage: Stage) -> str:
    d = out / stage.name
    if (d / "staleness.json").is_file():
        return "done"
    return "interrupted" if (d / "staleness_runs.partial.jsonl").is_file() else "to run"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.staleness_stages", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "staleness_stages",
                        help="one directory per stage, and combined/ (default benchmarks/results/staleness_stages)")
    parser.add_argument("--plan", type=Path, default=None, help="a YAML plan instead of the study's own")
    parser.add_argument("--only", default=None, help="comma-separated stage names to run (default: every stage); the "
                                                       "combined report waits for every stage it combines")
    parser.add_argument("--list", action="store_true", help="only list the stages, their runs and state")
    parser.add_argument("--quick", action="store_true", help="only the quick study (gepo, grpo, gspo at 0 and 64) into OUT/quick")
    args, study_options = parser.parse_known_args(argv)
    passed_on = {"--losses", "--staleness", "--seeds", "--first-seed", "--delay-shape", "--drop-older-than", "--out",
                 "--combine", "--resume", "--from-partial", "--report-only"}
    clash = sorted({o.split("=")[0] for o in study_options if o.split("=")[0] in passed_on})
    if clash:
        parser.error(f"{', '.join(clash)}: set by each stage (or by this command), not for all of them; "
                     "write a plan (--plan) to change a stage")
    if args.quick:
        return staleness.main(["--quick", "--out", str(args.out / "quick"), *study_options])
    try:
        stages = read_plan(args.plan) if args.plan else PLAN
    except ValueError as exc:
        parser.error(str(exc))
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in {s.name for s in stages}]
        if unknown:
            parser.error(f"--only: no stage {', '.join(unknown)}; the stages are {', '.join(s.name for s in stages)}")
        chosen = [s for s in stages if s.name in wanted]
    else:
        chosen = stages
    if args.list:
        for s in stages:
            print(f"{s.name:28s} {s.runs():4d} runs  {stage_state(args.out, s):11s} {s.why}")
        return 0
    total = sum(s.runs() for s in chosen if stage_state(args.out, s) != "done")
    print(f"{len(chosen)} stage(s), {total} run(s) to go, in {args.out}", flush=True)
    for i, s in enumerate(chosen, 1):
        state = stage_state(args.out, s)
        if state == "done":
            print(f"stage {i}/{len(chosen)} {s.name}: done already ({args.out / s.name / 'staleness.md'})", flush=True)
            continue
        print(f"stage {i}/{len(chosen)} {s.name}: {s.runs()} runs{', resuming' if state == 'interrupted' else ''}"
              f" ({s.why or s.losses})", flush=True)
        resume = ["--resume"] if state == "interrupted" else []
        code = staleness.main([*s.study_args(), *resume, "--out", str(args.out / s.name), *study_options])
        if code:
            return code
    # Only a complete set is combined: a report of some stages must not replace the whole study's.
    combined = [s for s in stages if s.combine]
    missing = [s.name for s in combined if stage_state(args.out, s) != "done"]
    if missing:
        print(f"not combined into {args.out / 'combined'} yet: {', '.join(missing)} not finished", flush=True)
    elif combined:
        print(f"combining {len(combined)} stage(s) into {args.out / 'combined'}", flush=True)
        staleness.main(["--combine", *(str(args.out / s.name) for s in combined), "--out", str(args.out / "combined")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
