"""POST /v1/responses: OpenAI's Responses API, answered through the chat path (`preft.gateway.responses`)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from preft.common.errors import InvalidArgument
from preft.gateway.deps import CallerDep, GenerationDep, ResponsesBodyDep, TokenizerDep
from preft.gateway.errors import validation_message
from preft.gateway.observability import started_s
from preft.gateway.responses import ResponseEvents, ResponseShape, in_responses_terms, output_items
from preft.gateway.routes.chat import start_chat
from preft.gateway.schemas import ChatBody
from preft.gateway.sse import stream_response

router = APIRouter(tags=["responses"])


@router.post("/v1/responses")
async def create_response(
    request: Request, caller: CallerDep, body: ResponsesBodyDep, generation: GenerationDep, tokenizer: TokenizerDep
) -> Response:
    body.refuse_unsupported()
    try:
        chat = ChatBody.model_validate(body.chat_fields())
    except ValidationError as e:
        raise InvalidArgument(in_responses_terms(validation_message(e.errors(include_input=False)))) from None
    response_id = f"resp_{uuid.uuid4().hex}"
    job, plan = await start_chat(caller, chat, generation, tokenizer, response_id)
    call_format = generation.settings.tool_call_format
    headers = {"x-request-id": response_id, **job.admission.headers()}
    shape = ResponseShape(body, response_id)
    if body.stream:
        streams = await generation.open_streams(job, started_s=started_s(request))
        render = ResponseEvents(shape, plan, call_format)
        return stream_response(generation, job, streams, render, include_usage=True, headers=headers, done=False)
    (out,) = await generation.complete(job, started_s=started_s(request))
    answer = shape.response(output_items(out, plan, call_format), out.finish_reason, out.usage)
    return JSONResponse(answer, headers=headers)
