"""Tool calling: each model family's call format, the prompt rendering, the output parser."""

from .formats import FORMATS, ToolFormat, detect
from .prompt import takes_tools, template_messages
from .stream import ToolCallStream

__all__ = ["FORMATS", "ToolCallStream", "ToolFormat", "detect", "takes_tools",
           "template_messages"]
