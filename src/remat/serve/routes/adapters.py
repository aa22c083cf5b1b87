"""GET/POST /lora-adapters (llama.cpp's shape): finished LoRA adapters and their global scales."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from remat.serve.body import openapi_body, reader
from remat.serve.errors import responses
from remat.serve.schemas import Adapter, LoraScales
from remat.serve.state import JobsDep

router = APIRouter(tags=["adapters"])


@router.get("/lora-adapters", response_model=list[Adapter], responses=responses(503))
async def get_adapters(jobs: JobsDep):
    """Every finished adapter; new ones start at scale 0 (not applied)."""
    return await run_in_threadpool(jobs.adapters)


@router.post("/lora-adapters", response_model=list[Adapter], responses=responses(400, 503),
             openapi_extra=openapi_body(LoraScales))
async def set_adapters(jobs: JobsDep, body: Annotated[LoraScales, Depends(reader(LoraScales))]):
    """Set the scales every request decodes with (unless it sends its own `lora`); unlisted adapters go to 0."""
    return await run_in_threadpool(jobs.set_scales, [x.model_dump() for x in body.root])
