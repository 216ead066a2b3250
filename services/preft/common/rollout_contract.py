"""The rollout server's wire contract: TRL's vLLM server protocol (what `trl vllm-serve` answers and TRL 1.16's
``VLLMClient`` calls), plus the one endpoint of ours that carries weight updates off CUDA.

TRL 1.16's ``trl vllm-serve`` runs ``vllm serve`` with its development endpoints; its client calls:

    GET  /health                        200 when up
    GET  /v1/models                     {"data": [{"id": <model>}]}: the first id is what every request names
    GET  /server_info                   {"vllm_config": {...}}: TRL reads weight_transfer_config (None: no updates)
                                        and model_config.logprobs_mode
    GET  /get_world_size                {"world_size": <workers>}: the trainer joins the NCCL group as rank 0
    POST /v1/completions                token-id prompts, n completions each (prompt-major), token ids and logprobs
    POST /init_weight_transfer_engine   {"init_info": InitInfo}: the server joins the trainer's NCCL group (CUDA)
    POST /start_weight_update           {}: an update begins
    POST /update_weights                {"update_info": UpdateInfo}: tensors follow by NCCL broadcast (CUDA)
    POST /finish_weight_update          {}: the update is complete
    POST /reset_prefix_cache            {"success": true}

Ours: ``POST /preft/update_weights`` with a safetensors body (`SAFETENSORS_MEDIA_TYPE`) replaces TRL's
``/update_weights`` + NCCL broadcast where there is no CUDA, between the same start and finish calls. Errors answer
like vLLM's server: ``{"object": "error", "message": ..., "type": ..., "code": <status>}``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from preft.common.engine_contract import MAX_COUNT, MAX_LOGPROBS, MAX_SEED

HTTP_UPDATE_PATH = "/preft/update_weights"
SAFETENSORS_MEDIA_TYPE = "application/x-safetensors"
TOKEN_PREFIX = "token_id:"  # how tokens are named with return_tokens_as_token_ids (vLLM's, which TRL parses)
MAX_COMPLETIONS_PER_PROMPT = 256
MAX_PROMPTS = 4096


class CompletionsRequest(BaseModel):
    """What TRL's ``VLLMClient.generate`` posts to /v1/completions (its ``generation_kwargs`` may add the sampling
    fields below). Prompts are token ids: TRL's trainers tokenize themselves."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: list[list[int]] = Field(min_length=1, max_length=MAX_PROMPTS)
    n: int = Field(1, ge=1, le=MAX_COMPLETIONS_PER_PROMPT)
    max_tokens: int = Field(16, ge=1, le=MAX_COUNT)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_COUNT, description="0 or -1: no truncation")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_COUNT)
    return_token_ids: bool = True  # (always answered: TRL asks for them)
    return_tokens_as_token_ids: bool = True  # (always: this server names tokens "token_id:<id>")

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_prompts(cls, value: Any) -> Any:
        """One token-id prompt, or a list of them; text prompts are refused (the trainer tokenizes)."""
        if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], str)):
            raise ValueError("this server takes token-id prompts (as TRL's trainers send them), not text")
        if isinstance(value, list) and value and isinstance(value[0], int):
            return [value]
        return value

    @field_validator("prompt")
    @classmethod
    def _non_empty_prompts(cls, value: list[list[int]]) -> list[list[int]]:
        if any(not p for p in value):
            raise ValueError("a prompt holds no tokens")
        return value


class InitInfo(BaseModel):
    """TRL's NCCL rendezvous: the trainer is rank 0 at master_address:master_port, the server's workers follow."""

    model_config = ConfigDict(extra="allow")  # (vLLM's packed-buffer geometry, when a trainer sends it)

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(1, ge=1)
    world_size: int = Field(ge=2)
    packed: bool = True


class InitRequest(BaseModel):
    init_info: InitInfo


class UpdateInfo(BaseModel):
    """The tensors an NCCL broadcast is about to carry, in order: names, dtypes (torch's names) and shapes."""

    model_config = ConfigDict(extra="allow")  # ("packed", sent by TRL for vLLM before 0.28)

    names: list[str] = Field(min_length=1)
    dtype_names: list[str]
    shapes: list[list[int]]


class UpdateRequest(BaseModel):
    update_info: UpdateInfo


class UpdateAnswer(BaseModel):
    """What /finish_weight_update (and ours) answer: the adapter's weight version now serving."""

    version: int = Field(description="Grows by one with every applied update; 0: the weights the server started on")
    tensors: int = Field(description="Tensors replaced by this update (0: nothing was staged)")
    seconds: float = Field(description="From the finish call to the new weights serving")


class ErrorBody(BaseModel):
    """vLLM's error answer, which TRL's client shows in its exception."""

    object: Literal["error"] = "error"
    message: str
    type: str
    code: int
