"""Fleet mode's functional core: Scheduled Events of many VMs from Azure's central feeds.

- `feed.py`: `FleetEvent` and the parsers for Resource Graph rows and Event Grid deliveries (a Storage
  queue message or an HTTPS push, Event Grid or CloudEvents schema), at the same bounded boundary as IMDS.
- `armid.py`: ARM resource IDs, split, compared without regard to case, and built.

Transports (Resource Graph paging, the queue, the push endpoint) sit outside and hand these parsers
bytes, text or decoded JSON.
"""
