"""POST /v1/completions: the completions service's answer (``openai.completions``), whole or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from preft.gateway.core.deps import CallerDep
from preft.gateway.core.observability import started_s
from preft.gateway.openai.completions import answer_completion, stream_completion
from preft.gateway.openai.deps import CompletionBodyDep, GenerationDep

router = APIRouter(tags=["completions"])


@router.post("/v1/completions")
async def create_completion(
    request: Request, caller: CallerDep, body: CompletionBodyDep, generation: GenerationDep
) -> Response:
    if body.stream:
        return (await stream_completion(generation, caller, body, started_s=started_s(request))).response()
    answer = await answer_completion(generation, caller, body, started_s=started_s(request))
    return JSONResponse(answer.body, headers=answer.headers)
