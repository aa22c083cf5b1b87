"""Training jobs: POST /train/plan (plan and gate, nothing queued), POST /train, GET /train, GET/DELETE
/train/{id}, POST /train/{id}/cancel and /resume (OpenAI's fine-tuning conventions), and the job's events as
server-sent events (GET /train/{id}/events, resumable with Last-Event-ID)."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from starlette.concurrency import run_in_threadpool

from remat.serve import body
from remat.serve import generation as gen
from remat.serve.errors import ApiError, SafeJSONResponse, responses
from remat.serve.jobs import FINISHED, MAX_EVENT_ID, JobManager
from remat.serve.schemas import Deleted, EventList, Job, JobList, Longest, Plan, PlanRequest, Submitted, TrainRequest
from remat.serve.state import JobsDep

router = APIRouter(tags=["training"])
EventId = Annotated[int | None, Query(ge=0, le=MAX_EVENT_ID, description="resume after this event id")]
LAST_EVENT_ID = "^[0-9]{1,18}$"  # an event id as the header says it: ASCII digits, at most 18 (all below 2**63)
# Typed `str`, not `str | None`: the document says a string or nothing (a client's None is no header at all).
# The pattern is documented here and checked by `_last_event_id` (an error that names the header).
LastEventId = Annotated[str, Header(json_schema_extra={"pattern": LAST_EVENT_ID},
                                    description="resume after this event id")]


async def train_body(request: Request) -> body.Parsed[TrainRequest]:
    """The job, parsed and validated in a worker thread: a large body (training data) never holds the event
    loop (the OpenAPI document declares it with `openapi_extra`)."""
    return await body.read(request, TrainRequest)


async def plan_body(request: Request) -> body.Parsed[PlanRequest]:
    """A job to plan, as `train_body` reads a job (its ctx may be "max")."""
    return await body.read(request, PlanRequest)


TrainBody = Annotated[body.Parsed[TrainRequest], Depends(train_body)]
TRAIN_BODY = body.openapi_body(TrainRequest, "a training job: its data and TrainSettings' fields")
PlanBody = Annotated[body.Parsed[PlanRequest], Depends(plan_body)]
PLAN_BODY = body.openapi_body(PlanRequest, "a training job as POST /train takes it; ctx may be max")


@router.post("/train", status_code=202, response_model=Submitted, responses=responses(400, 422, 429, 503),
             openapi_extra=TRAIN_BODY)
async def train(req: TrainBody, jobs: JobsDep):
    """Plan the job on fake tensors and queue it (202 with the plan, `Location` naming the job), or refuse it:
    422 `insufficient_memory` with the plans the gate looked at when none fits the budget; 429 `queue_full` when
    as many jobs as the server queues (`--max-queued-jobs`) are waiting."""
    answer = await body.answer(jobs.submit, req)
    return SafeJSONResponse(answer, status_code=202, headers={"Location": f"/train/{answer['id']}"})


@router.post("/train/plan", response_model=Plan | Longest, responses=responses(400, 422, 503),
             openapi_extra=PLAN_BODY)
async def train_plan(req: PlanBody, jobs: JobsDep):
    """What `POST /train` would answer, without queueing anything: the plans, the gate's choice and its
    reason (200), or 422 `insufficient_memory` with the plans when none fits the budget. With `"ctx": "max"`:
    the longest window within the budget on each path, with the gate's plans there (`remat plan --ctx max`)."""
    return SafeJSONResponse(await body.answer(jobs.plan, req))


@router.get("/train", response_model=JobList, responses=responses(503))
async def train_list(jobs: JobsDep):
    """Every job, oldest first."""
    return {"object": "list", "data": await run_in_threadpool(jobs.list)}


@router.get("/train/{job_id}", response_model=Job, responses=responses(404, 503))
async def train_get(job_id: str, jobs: JobsDep):
    """One job: status, progress, losses, plan, timings, its adapter."""
    return await run_in_threadpool(jobs.get, job_id)


@router.post("/train/{job_id}/cancel", response_model=Job, responses=responses(404, 409, 503))
async def train_cancel(job_id: str, jobs: JobsDep):
    """Cancel a queued job at once, a running one at its next chunk; the job stays, `cancelled` (resumable).
    409 when it already finished."""
    return await run_in_threadpool(jobs.cancel, job_id)


@router.delete("/train/{job_id}", response_model=Deleted, responses=responses(404, 409, 503))
async def train_delete(job_id: str, jobs: JobsDep):
    """Remove a finished job's record and events (its published adapter or model stays); 409 while it is
    queued or running: cancel it first."""
    return await run_in_threadpool(jobs.delete, job_id)


@router.post("/train/{job_id}/resume", status_code=202, response_model=Job,
             responses=responses(404, 409, 422, 429, 503))
async def train_resume(job_id: str, jobs: JobsDep):
    """Requeue a failed or cancelled job from its last checkpoint (429 `queue_full` as for a new job)."""
    return SafeJSONResponse(await run_in_threadpool(jobs.resume, job_id), status_code=202)


def _last_event_id(header: str | None, after: int | None) -> int:
    if header is None:
        return -1 if after is None else after
    if not re.fullmatch(LAST_EVENT_ID, header):
        raise ApiError(400, f"Last-Event-ID '{header[:40]}' is not an event id (at most 18 digits)",
                       extra={"param": "Last-Event-ID"})
    return int(header)


async def _events(jobs: JobManager, job_id: str, after: int, request: Request):
    last = after
    yield "retry: 1000\n\n"
    while True:
        status = (await run_in_threadpool(jobs.get, job_id)).get("status")
        batch = await run_in_threadpool(jobs.wait_events, job_id, last, 0.5 if status in FINISHED else 10.0)
        for ev in batch:
            last = int(ev["id"])
            yield gen.sse(ev.get("data", {}), event=ev.get("event", "message"), id=last)
        if status in FINISHED and not batch:
            return
        if not batch:
            if await request.is_disconnected():
                return
            yield ": keep-alive\n\n"


@router.get("/train/{job_id}/events", response_model=EventList, responses={
    200: {"description": "The job's events as server-sent events (`id`, `event`, `data`); with `stream=false`, "
                         "one JSON list", "content": {"text/event-stream": {"schema": gen.SSE_EVENT}}},
    **responses(400, 404, 503)})
async def train_events(job_id: str, request: Request, jobs: JobsDep, after: EventId = None,
                       stream: bool = True,
                       last_event_id: LastEventId = None):  # type: ignore[assignment]
    """Progress as server-sent events; `Last-Event-ID` or `?after=N` resumes after event N. The stream ends
    after the job's last event. `?stream=false`: the events so far as one JSON list."""
    after = _last_event_id(last_event_id, after)
    await run_in_threadpool(jobs.get, job_id)  # 404 for an unknown job, before the stream starts
    if not stream:
        return {"object": "list", "data": await run_in_threadpool(jobs.events_since, job_id, after)}
    return gen.event_stream(_events(jobs, job_id, after, request))
