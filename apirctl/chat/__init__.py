"""Chat with a served model: the OpenAI-compatible streaming client and a conversation's state
(`client`), and what is typed (`composer`). The interactive session and how its answers appear are
the CLI's (`apirctl.cli.chat_session`, `apirctl.cli.chat_view`): this package prints nothing."""

from __future__ import annotations

from apirctl.chat.client import (
    NOT_A_CHAT_MODEL,
    ChatClient,
    Conversation,
    Reply,
    ServerError,
    StillLoading,
    Timings,
    format_stats,
    image_part,
    normalize_base_url,
    read_prompt,
    user_message,
)

__all__ = ["NOT_A_CHAT_MODEL", "ChatClient", "Conversation", "Reply", "ServerError", "StillLoading", "Timings",
           "format_stats", "image_part", "normalize_base_url", "read_prompt", "user_message"]
