"""Protocol constants of APIR: version, handshake magic, command types and return-code tables.

Values are those of the pinned llama.cpp source (`backend/shared/api_remoting.h`, `apir_backend.h`);
tests/apir compares them with the C headers so a new upstream version cannot drift silently.
"""

from __future__ import annotations

from enum import IntEnum

PROTOCOL_MAJOR = 0
PROTOCOL_MINOR = 2
HANDSHAKE_MAGIC = 0xAB1E

# Without the dedicated APIR capset the frontend shifts its command types past Venus' own
# command types, so that virglrenderer can route them (VIRGL_ROUTE_VENUS_TO_APIR).
VENUS_COMMAND_TYPE_LENGTH = 331

# Every command starts with this header: command type (int32), flags (int32; for FORWARD the
# function index) and the resource id of the reply buffer (uint32).
COMMAND_HEADER_SIZE = 12
# The reply buffer starts with a uint32 notification word: 0 while pending, return code + 1 after.
REPLY_NOTIFICATION_SIZE = 4

# The frontend's command encoder is a fixed 4 KiB buffer: bulk data goes through shared memory.
COMMAND_BUFFER_SIZE = 4096


class CommandType(IntEnum):
    """Top-level command types virglrenderer's APIR component understands."""

    HANDSHAKE = 0
    LOADLIBRARY = 1
    FORWARD = 2


class LoadLibraryCode(IntEnum):
    """Return codes of LOADLIBRARY; INIT_BASE_INDEX + n carries the backend library's own code n."""

    SUCCESS = 0
    HYPERCALL_INITIALIZATION_ERROR = 1
    ALREADY_LOADED = 2
    ENV_VAR_MISSING = 3
    CANNOT_OPEN = 4
    SYMBOL_MISSING = 5
    INIT_BASE_INDEX = 6


class ForwardCode(IntEnum):
    """Return codes of FORWARD; BASE_INDEX + n carries the dispatched function's own code n."""

    SUCCESS = 0
    NO_DISPATCH_FCT = 1
    TIMEOUT = 2
    FAILED_TO_SYNC_STREAMS = 3
    BASE_INDEX = 4


class BackendInitCode(IntEnum):
    """What the backend library's `backend_dispatch_initialize` answers (after the base index)."""

    SUCCESS = 0
    CANNOT_OPEN_BACKEND_LIBRARY = 1
    CANNOT_OPEN_GGML_LIBRARY = 2
    MISSING_BACKEND_SYMBOLS = 3
    MISSING_GGML_SYMBOLS = 4
    BACKEND_FAILED = 5
    BACKEND_REG_FAILED = 6
    ALREADY_INITED = 7
    NO_DEVICE = 8
    BACKEND_INIT_FAILED = 9


# The dispatcher answers this for a function index outside the table.
FORWARD_INDEX_INVALID = 6

# Keys of the backend library's `get_config` callback.
CONFIG_LIBRARY_PATH = "ggml.library.path"
CONFIG_LIBRARY_REG = "ggml.library.reg"
DEFAULT_REG_SYMBOL = "ggml_backend_init"


class GgmlStatus(IntEnum):
    """`enum ggml_status`, the reply of graph_compute."""

    ALLOC_FAILED = -2
    FAILED = -1
    SUCCESS = 0
    ABORTED = 1


class DeviceType(IntEnum):
    """`enum ggml_backend_dev_type`, the reply of device_get_type."""

    CPU = 0
    GPU = 1
    IGPU = 2
    ACCEL = 3
    META = 4


def describe_load_library(code: int) -> str:
    """Name a LOADLIBRARY answer, splitting off the backend library's own initialization code."""
    if code >= LoadLibraryCode.INIT_BASE_INDEX:
        inner = code - LoadLibraryCode.INIT_BASE_INDEX
        try:
            return f"backend init: {BackendInitCode(inner).name}"
        except ValueError:
            return f"backend init: unknown code {inner}"
    try:
        return LoadLibraryCode(code).name
    except ValueError:
        return f"unknown code {code}"
