"""POST /v1/chat/completions: the chat service's answer (``openai.chat``), whole or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from preft.gateway.core.deps import CallerDep
from preft.gateway.core.observability import started_s
from preft.gateway.core.openapi import GENERATION_ERRORS, errors, event_stream
from preft.gateway.openai.chat import answer_chat, stream_chat
from preft.gateway.openai.deps import ChatBodyDep, GenerationDep
from preft.gateway.openai.response_models import ChatCompletion

router = APIRouter(tags=["chat"])


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    responses={**event_stream("chat.completion.chunk events, then [DONE]"), **errors(*GENERATION_ERRORS)},
)
async def create_chat_completion(
    request: Request, caller: CallerDep, body: ChatBodyDep, generation: GenerationDep
) -> Response:
    if body.stream:
        return (await stream_chat(generation, caller, body, started_s=started_s(request))).response()
    answer = await answer_chat(generation, caller, body, started_s=started_s(request))
    return JSONResponse(answer.body, headers=answer.headers)
