"""GET /metrics in Prometheus' text format: serving, the scheduler, training jobs."""

from __future__ import annotations


class _Out:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.typed: set[str] = set()

    def __call__(self, name: str, kind: str, help: str, value: float | None, labels: str = "") -> None:
        if value is None:
            return
        if name not in self.typed:
            self.typed.add(name)
            self.lines += [f"# HELP remat_{name} {help}", f"# TYPE remat_{name} {kind}"]
        self.lines.append(f"remat_{name}{labels} {value!r}" if isinstance(value, float) else
                          f"remat_{name}{labels} {int(value)}")


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _job_steps(job: dict) -> int:
    for key in ("step", "steps_done", "steps"):
        v = job.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return len(job.get("losses") or [])


def _serving(metric: _Out, srv) -> None:
    e = srv.engine
    st = dict(e.stats) if e is not None else {}
    metric("requests_total", "counter", "Generation requests finished.", st.get("requests", 0))
    metric("prompt_tokens_total", "counter", "Prompt tokens evaluated.", st.get("prompt_tokens", 0))
    metric("tokens_predicted_total", "counter", "Tokens generated.", st.get("tokens_predicted", 0))
    decode_s = st.get("decode_seconds", 0.0)
    metric("decode_tokens_per_second", "gauge", "Generated tokens per second of decoding, per request.",
           float(st.get("tokens_predicted", 0) / decode_s) if decode_s else 0.0)
    metric("decode_steps_total", "counter", "Decode steps (one forward over the batch of decoding sequences).",
           st.get("decode_steps", 0))
    metric("decode_rows_total", "counter", "Sequences over all decode steps (over the steps: the mean batch).",
           st.get("decode_rows", 0))
    metric("requests_processing", "gauge", "Sequences decoding now (busy slots).", e.decoder.busy if e else 0)
    metric("requests_deferred", "gauge", "Sequences waiting for a slot.", e.decoder.waiting if e else 0)
    metric("kv_cache_bytes", "gauge", "Bytes the decode slots' KV caches hold.", e.kv_cache_bytes() if e else 0)
    metric("slots_total", "gauge", "Requests that may decode at once (--parallel).", srv.parallel)
    metric("model_loaded", "gauge", "1 once the model is loaded.", int(bool(e and e.ready.is_set())))


def _scheduler(metric: _Out, srv) -> None:
    try:
        s = srv.scheduler.stats()
    except Exception:  # noqa: BLE001 - metrics never fail because a part does
        s = {}
    metric("training_chunks_total", "counter", "Training chunks run.", s.get("chunks"))
    metric("training_window_p50_seconds", "gauge", "Median time a decode could wait for a training chunk.",
           _num(s.get("window_p50")))
    metric("training_window_p95_seconds", "gauge", "95th percentile of a training chunk's window.",
           _num(s.get("window_p95")))
    metric("training_waited_seconds_total", "counter", "Time training yielded to decoding.",
           _num(s.get("waited_seconds")))
    metric("slowdown_ppm", "gauge", "Measured decode slowdown from training, parts per million.",
           _num(s.get("slowdown_ppm")))
    metric("max_slowdown_ppm", "gauge", "Allowed decode slowdown (--max-slowdown-ppm).",
           _num(s.get("max_slowdown_ppm", srv.max_slowdown_ppm)))


def _current_job(metric: _Out, job: dict) -> None:
    losses = job.get("losses") or []
    metric("training_last_loss", "gauge", "Loss of the last step of the running (or last) job.",
           _num(job.get("loss", losses[-1] if losses else None)))
    plan = job.get("plan") or {}
    for k in ("total", "graph"):
        metric("training_planned_bytes", "gauge", "Planned memory of the running (or last) job.",
               _num(plan.get(k)) if isinstance(plan, dict) else None, f'{{kind="{k}"}}')
    measured = job.get("measured") or {}
    if isinstance(measured, dict):
        for k, v in measured.items():
            if _num(v) is not None:
                metric("training_measured_bytes", "gauge", "Measured memory of the running (or last) job.", v,
                       f'{{kind="{k}"}}')


def _jobs(metric: _Out, srv) -> None:
    try:
        job_list = srv.jobs.list()
    except Exception:  # noqa: BLE001
        job_list = []
    by_status: dict[str, int] = {}
    for j in job_list:
        by_status[j.get("status", "unknown")] = by_status.get(j.get("status", "unknown"), 0) + 1
    for status in sorted(by_status):
        metric("training_jobs", "gauge", "Training jobs by status.", by_status[status], f'{{status="{status}"}}')
    metric("training_steps_total", "counter", "Optimizer steps taken by all training jobs.",
           sum(_job_steps(j) for j in job_list))
    current = next((j for j in job_list if j.get("status") == "running"), job_list[-1] if job_list else None)
    if current is not None:
        _current_job(metric, current)


def metrics_text(srv) -> str:
    metric = _Out()
    _serving(metric, srv)
    if srv.scheduler is not None:
        _scheduler(metric, srv)
    if srv.jobs is not None:
        _jobs(metric, srv)
    return "\n".join(metric.lines) + "\n"
