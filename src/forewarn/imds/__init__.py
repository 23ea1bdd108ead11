"""Everything that speaks to, or describes, the Azure Instance Metadata Service."""

from forewarn.imds.document import Document, DocumentError, Event, parse_document
from forewarn.imds.instance import VmInfo, parse_compute

__all__ = ["Document", "DocumentError", "Event", "VmInfo", "parse_compute", "parse_document"]
