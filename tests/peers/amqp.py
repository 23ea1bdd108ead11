"""A local AMQP 1.0 peer that the real azure-eventhub producer sends to, for tests.

It listens on loopback without TLS (the client speaks plain AMQP for `UseDevelopmentEmulator=true`
connection strings) and answers what a producer needs: the SASL exchange (ANONYMOUS, PLAIN or MSSBCBS,
all accepted), Open/Begin/Attach with link credit and a max message size, `$cbs` put-token requests,
a `$management` READ of the hub (name and partition ids), and an Accepted disposition for every
message it keeps. It can be told to refuse (Rejected) or to stall, and keeps what it received.

Frames are encoded and decoded with the AMQP 1.0 codec that ships inside azure-eventhub (its pyamqp
package). Qpid Proton was tried first, but it cannot send the session properties that this client
reads by position from every Begin frame; the codec here writes every field, as Event Hubs does.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
import uuid
from typing import Any

from azure.eventhub._pyamqp import performatives as P
from azure.eventhub._pyamqp._decode import decode_frame, decode_payload
from azure.eventhub._pyamqp._encode import encode_frame, encode_payload
from azure.eventhub._pyamqp.endpoints import Source, Target
from azure.eventhub._pyamqp.message import Message, Properties
from azure.eventhub._pyamqp.outcomes import Accepted, Rejected
from azure.eventhub._pyamqp.types import TYPE, VALUE, AMQPTypes

SASL_HEADER = b"AMQP\x03\x01\x00\x00"
AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
SASL_FRAME = b"\x01"
BATCH_FORMAT = 0x80013700
MAX_FRAME = 65536


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def connection_string(port: int, hub: str = "scheduled-events") -> str:
    """A development-emulator connection string (plain AMQP) for a peer on loopback `port`."""
    return (f"Endpoint=sb://127.0.0.1:{port};SharedAccessKeyName=RootManageSharedAccessKey;"
            f"SharedAccessKey=SAS_KEY_VALUE;EntityPath={hub};UseDevelopmentEmulator=true")


class Received:
    """What the peer kept (each message decoded), and how it behaves next."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.times: list[float] = []  # time.monotonic() of each message's arrival, for the benchmarks
        self.tokens = 0
        self.management_reads = 0
        self.reject = False
        self.delay = 0.0
        self.lock = threading.Lock()

    def events(self) -> list[Message]:
        with self.lock:
            return list(self.messages)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, memoryview)) else str(value)


class _Connection:
    def __init__(self, sock: socket.socket, peer: AmqpPeer) -> None:
        self.sock = sock
        self.peer = peer
        self.links: dict[tuple[int, int], dict[str, Any]] = {}   # (channel, remote handle) -> link
        self.senders: dict[tuple[int, str], int] = {}             # (channel, source address) -> our handle
        self.partial: dict[tuple[int, int], bytearray] = {}
        self.next_handle = 0
        self.delivery_id = 0

    # --- wire ----------------------------------------------------------------------------------
    def read_exact(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return bytes(data)

    def read_frame(self) -> tuple[int, int, list[Any] | None]:
        size = struct.unpack(">I", self.read_exact(4))[0]
        rest = self.read_exact(size - 4)
        doff, _, channel = rest[0], rest[1], struct.unpack(">H", rest[2:4])[0]
        body = rest[doff * 4 - 4:]
        if not body:
            return channel, -1, None  # heartbeat
        code, fields = decode_frame(memoryview(body))
        return channel, code, fields

    def send(self, channel: int, frame: Any, frame_type: bytes = b"\x00") -> None:
        header, body = encode_frame(frame, frame_type)
        header = header[:6] + struct.pack(">H", channel)
        self.sock.sendall(header + (body or b""))

    # --- protocol -------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            if self.read_exact(8) != SASL_HEADER:
                return
            self.sock.sendall(SASL_HEADER)
            self.send(0, P.SASLMechanism(sasl_server_mechanisms=[b"MSSBCBS", b"PLAIN", b"ANONYMOUS"]), SASL_FRAME)
            self.read_frame()  # SASL init: every mechanism is accepted
            self.send(0, P.SASLOutcome(code=0, additional_data=None), SASL_FRAME)
            if self.read_exact(8) != AMQP_HEADER:
                return
            self.sock.sendall(AMQP_HEADER)
            while True:
                channel, code, fields = self.read_frame()
                if fields is not None and not self.handle(channel, code, fields):
                    return
        except (ConnectionError, OSError):
            return
        finally:
            self.sock.close()

    def handle(self, channel: int, code: int, f: list[Any]) -> bool:
        if code == 0x10:  # open
            self.send(0, P.OpenFrame(container_id="forewarn-test-peer", hostname=None, max_frame_size=MAX_FRAME,
                                     channel_max=255, idle_timeout=None, outgoing_locales=None,
                                     incoming_locales=None, offered_capabilities=None, desired_capabilities=None,
                                     properties={b"product": b"forewarn-test-peer"}))
        elif code == 0x11:  # begin
            self.send(channel, P.BeginFrame(remote_channel=channel, next_outgoing_id=0, incoming_window=65536,
                                            outgoing_window=65536, handle_max=255, offered_capabilities=None,
                                            desired_capabilities=None, properties={}))
        elif code == 0x12:  # attach
            self.attach(channel, f)
        elif code == 0x14:  # transfer
            self.transfer(channel, f)
        elif code == 0x16:  # detach
            self.send(channel, P.DetachFrame(handle=f[0], closed=True, error=None))
        elif code == 0x17:  # end
            self.send(channel, P.EndFrame(error=None))
        elif code == 0x18:  # close
            self.send(0, P.CloseFrame(error=None))
            return False
        return True  # flow and disposition need no answer here

    def attach(self, channel: int, f: list[Any]) -> None:
        name, remote_handle, client_is_receiver = f[0], f[1], bool(f[2])
        source = _text(f[5][0]) if f[5] else ""
        target = _text(f[6][0]) if f[6] else ""
        handle = self.next_handle
        self.next_handle += 1
        self.links[(channel, remote_handle)] = {"target": target, "source": source, "handle": handle}
        if client_is_receiver:
            self.senders[(channel, source)] = handle
        self.send(channel, P.AttachFrame(
            name=name, handle=handle, role=not client_is_receiver, send_settle_mode=f[3], rcv_settle_mode=f[4],
            source=Source(address=source or None), target=Target(address=target or None), unsettled=None,
            incomplete_unsettled=None, initial_delivery_count=0, max_message_size=self.peer.max_message_size,
            offered_capabilities=None, desired_capabilities=None, properties=None))
        if not client_is_receiver:
            self.send(channel, P.FlowFrame(next_incoming_id=0, incoming_window=65536, next_outgoing_id=0,
                                           outgoing_window=65536, handle=handle, delivery_count=0, link_credit=1000,
                                           available=None, drain=None, echo=None, properties=None))

    def transfer(self, channel: int, f: list[Any]) -> None:
        key = (channel, f[0])
        payload = self.partial.pop(key, bytearray()) + bytes(f[11])
        if f[5]:  # more frames of this delivery follow
            self.partial[key] = payload
            return
        link = self.links[key]
        message = decode_payload(memoryview(payload))
        received = self.peer.received
        if link["target"] in ("$cbs", "$management"):
            self.reply(channel, link["target"], message)
            outcome: Any = Accepted()
        else:
            if received.delay:
                time.sleep(received.delay)
            if received.reject:
                outcome = Rejected(error=None)
            else:
                inner = [decode_payload(memoryview(bytes(d))) for d in (message.data or [])]
                accepted = inner if f[3] == BATCH_FORMAT else [message]
                with received.lock:
                    received.messages.extend(accepted)
                    received.times.extend([time.monotonic()] * len(accepted))
                outcome = Accepted()
        if f[1] is not None and not f[4]:
            self.send(channel, P.DispositionFrame(role=True, first=f[1], last=f[1], settled=True, state=outcome,
                                                  batchable=None))

    def reply(self, channel: int, node: str, request: Message) -> None:
        received = self.peer.received
        if node == "$cbs":
            with received.lock:
                received.tokens += 1
            status, body = 202, None
        else:
            with received.lock:
                received.management_reads += 1
            status = 200
            created = {TYPE: AMQPTypes.timestamp, VALUE: int(time.time() * 1000)}
            body = {b"name": self.peer.hub.encode(), b"created_at": created,
                    b"partition_count": 2, b"partition_ids": [b"0", b"1"]}
        request_props = request.properties
        reply = Message(
            properties=Properties(message_id=str(uuid.uuid4()), correlation_id=request_props.message_id,
                                  to=request_props.reply_to),
            application_properties={b"status-code": status, b"status-description": b"OK"},
            value=body,
        )
        handle = self.senders.get((channel, node))
        if handle is None:
            return
        payload = encode_payload(bytearray(), reply)
        self.send(channel, P.TransferFrame(handle=handle, delivery_id=self.delivery_id,
                                           delivery_tag=struct.pack(">I", self.delivery_id), message_format=0,
                                           settled=True, more=False, payload=bytes(payload)))
        self.delivery_id += 1


class AmqpPeer:
    """The peer on loopback; `connection_string` is what forewarn is given."""

    def __init__(self, hub: str = "scheduled-events", port: int | None = None,
                 max_message_size: int = 1024 * 1024) -> None:
        self.hub = hub
        self.max_message_size = max_message_size  # what each link offers: the producer's batch size limit
        self.port = port or free_port()
        self.received = Received()
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", self.port))
        self.server.listen()
        self.connections: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            self.connections.append(sock)
            threading.Thread(target=_Connection(sock, self).run, daemon=True).start()

    @property
    def connection_string(self) -> str:
        return connection_string(self.port, self.hub)

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # wakes the accept() in progress: the port is free for a new peer
            self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        for sock in self.connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            except OSError:
                pass
