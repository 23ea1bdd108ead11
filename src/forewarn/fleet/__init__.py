"""Fleet mode, `forewarn fleet`: Scheduled Events of many VMs from Azure's central feeds (docs/fleet.md).

- `feed.py`, `armid.py`: the boundary: Resource Graph rows and Event Grid deliveries (queue message or HTTPS
  push, Event Grid or CloudEvents schema) into `FleetEvent`; ARM resource IDs.
- `tracker.py`, `records.py`, `state.py`: the functional core: one state per event moving forward only, its
  changes as the per-VM agent's records, the tracker saved in the outbox's transaction.
- `resourcegraph.py`, `queue.py`, `push.py`, `arm.py`: the transports, each bounded in size and time.
- `lease.py`, `handover.py`, `scope.py`, `metrics.py`, `service.py`: one active replica and what it hands its
  successor, what this instance answers for, the metrics, the service that wires them.
- `approval.py`, `acks.py`, `acknowledge.py`, `nodeactions.py`, `nodes.py`, `gone.py`: acting from one place:
  the policy's decisions, acknowledgements through ARM, node actions on the VMs' AKS nodes.
"""
