"""Chat with a served model: the OpenAI-compatible streaming client (`client`), the interactive
session, what is typed (`composer`) and how answers appear (`view`)."""

from __future__ import annotations

from apirctl.chat.client import (
    NOT_A_CHAT_MODEL,
    ChatClient,
    Reply,
    ServerError,
    Session,
    StillLoading,
    Timings,
    format_stats,
    image_part,
    normalize_base_url,
    read_prompt,
    user_message,
)

__all__ = ["NOT_A_CHAT_MODEL", "ChatClient", "Reply", "ServerError", "Session", "StillLoading", "Timings",
           "format_stats", "image_part", "normalize_base_url", "read_prompt", "user_message"]
