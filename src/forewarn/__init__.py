"""forewarn: advance warning of Azure VM maintenance from IMDS Scheduled Events."""

__version__ = "0.1.0"

#: The Scheduled Events API version forewarn asks for unless told otherwise.
DEFAULT_API_VERSION = "2020-07-01"
