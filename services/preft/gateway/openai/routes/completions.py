"""POST /v1/completions: the completions service's answer (``openai.completions``), whole or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from preft.gateway.core.deps import CallerDep
from preft.gateway.core.observability import started_s
from preft.gateway.core.openapi import GENERATION_ERRORS, errors, event_stream
from preft.gateway.openai.completions import answer_completion, stream_completion
from preft.gateway.openai.deps import CompletionBodyDep, GenerationDep
from preft.gateway.openai.response_models import Completion

router = APIRouter(tags=["completions"])


@router.post(
    "/v1/completions",
    response_model=Completion,
    responses={**event_stream("text_completion chunks, then [DONE]"), **errors(*GENERATION_ERRORS)},
)
async def create_completion(
    request: Request, caller: CallerDep, body: CompletionBodyDep, generation: GenerationDep
) -> Response:
    if body.stream:
        return (await stream_completion(generation, caller, body, started_s=started_s(request))).response()
    answer = await answer_completion(generation, caller, body, started_s=started_s(request))
    return JSONResponse(answer.body, headers=answer.headers)
