"""The report's headline and per-step figures into an experiment tracker: MLflow (``commpatch report
--mlflow URI``; optional extra ``mlflow``) and Weights & Biases (``--wandb PROJECT``; extra ``wandb``),
beside the TensorBoard scalars (``render.tensorboard``).

What is logged is the report's own figures, so the tracker shows what the report says: per step of
the report's steps table (the job's step, all ranks), ``commpatch/step/time_ms``,
``.../comm_share``, ``.../exposed_share``, ``.../comm_ms``, ``.../exposed_ms``; once, the
headline's (``commpatch/run/step_p50_ms``, ``.../step_p95_ms``, the shares, the straggler rank and
how long the others wait for it; the straggler and hang verdicts as tags ``commpatch/straggler``,
``commpatch/hang``). An unknown figure (NaN, None) is left out, never logged as 0.
MLflow and W&B read their own settings from the environment as they always do (``MLFLOW_*``,
``WANDB_MODE=offline``, ``WANDB_DIR``, an API key): nothing of theirs is set here."""

from __future__ import annotations

import math
import os

from .tensorboard import STEP_TAGS

PREFIX = "commpatch/"
STEP = PREFIX + "step/"  # per step: the series
RUN = PREFIX + "run/"  # once: the headline's figures
# name -> (column of the steps table, scale): TensorBoard's per-step scalars, under the same names
STEP_METRICS = {tag.split("/", 1)[1]: (column, scale) for tag, column, scale in STEP_TAGS}


def _number(value) -> float | None:
    """``value`` as a float, or None when unknown (None, NaN)."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def step_points(steps) -> list[tuple[int, dict]]:
    """[(step, {metric: value})] from the report's steps table, known values only, in step order."""
    out = []
    for row in steps.sort_values("step").itertuples(index=False):
        point = {}
        for name, (column, scale) in STEP_METRICS.items():
            value = _number(getattr(row, column, None))
            if value is not None:
                point[STEP + name] = value * scale
        if point:
            out.append((int(row.step), point))
    return out


def summary(headline: dict) -> tuple[dict, dict]:
    """(metrics, tags) from the report's headline: numbers the tracker can plot and compare across
    runs, and words (verdicts) it keeps as tags. Unknown figures are left out."""
    h = headline or {}
    metrics = {
        "step_p50_ms": h.get("step_us") and h["step_us"] * 1e-3,
        "step_p95_ms": h.get("step_p95_us") and h["step_p95_us"] * 1e-3,
        "comm_share": h.get("comm_share"),
        "exposed_share": h.get("exposed_share"),
        "wait_share": h.get("wait_share"),
        "mismatches": h.get("mismatches"),
        "ranks": h.get("ranks"),
    }
    s = h.get("straggler") or {}
    tags = {"straggler": str(s.get("verdict", "unknown")), "hang": str((h.get("hang") or {}).get("verdict", "unknown"))}
    if s.get("verdict") == "straggler":
        metrics["straggler_rank"] = s.get("rank")
        metrics["straggler_wait_ms"] = s.get("late_median_us") and s["late_median_us"] * 1e-3
        tags["straggler"] = f"rank {s.get('rank')}"
    numbers = {RUN + k: _number(v) for k, v in metrics.items()}
    known = {k: v for k, v in numbers.items() if v is not None}
    return known, {PREFIX + k: v for k, v in tags.items()}


def log_mlflow(rep, uri: str, experiment: str, run_name: str) -> str:
    """A new MLflow run named ``run_name`` in ``experiment`` at the tracking server ``uri``, with the
    report's figures; returns its run id."""
    from mlflow import MlflowClient  # needs the mlflow extra

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
    run = client.create_run(experiment_id, run_name=run_name)
    from mlflow.entities import Metric, RunTag

    metrics, tags = summary(rep.headline)
    points = [Metric(k, v, 0, 0) for k, v in metrics.items()]
    points += [Metric(k, v, 0, step) for step, point in step_points(rep.sections["steps"]) for k, v in point.items()]
    status = "FINISHED"
    try:
        for i in range(0, len(points), 1000):  # MLflow's batch limit
            client.log_batch(
                run.info.run_id,
                metrics=points[i : i + 1000],
                tags=[RunTag(k, v) for k, v in tags.items()] if i == 0 else [],
            )
    except BaseException:
        status = "FAILED"
        raise
    finally:
        client.set_terminated(run.info.run_id, status=status)
    return run.info.run_id


def log_wandb(rep, project: str, run_name: str) -> str:
    """A new W&B run named ``run_name`` in ``project`` with the report's figures (W&B's step: the
    job's step); returns the run's directory (offline) or URL."""
    import wandb  # needs the wandb extra

    # a run of its own beside any of the caller's (W&B's default would return the caller's active run,
    # or finish it in a notebook)
    run = wandb.init(project=project, name=run_name, reinit="create_new")
    try:
        for step, point in step_points(rep.sections["steps"]):
            run.log(point, step=step)
        metrics, tags = summary(rep.headline)
        run.summary.update({**metrics, **tags})
        where = run.url or os.path.dirname(os.path.normpath(run.dir))  # offline: the run's directory
    finally:
        run.finish()
        _wandb_written(wandb)
    return where


def _wandb_written(wandb) -> None:
    """Waits until W&B's service has written the run out: ``run.finish()`` only tells the service the
    run is done (its ``.wandb`` file may still be open, part of it unwritten, when it returns). With no
    other run of this process active, ``wandb.teardown()`` waits for the service to close it; a later
    ``wandb.init`` starts a new one. Beside a run of the caller's, the service stays and W&B writes the
    file by the process's exit (its own atexit hook)."""
    unset = object()
    active = getattr(wandb.setup(), "most_recent_active_run", unset)
    if active is None:
        wandb.teardown()
