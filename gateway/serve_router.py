"""Session-affine request routing for Ray Serve: requests of one conversation go to the
replica that already holds its KV blocks and stored responses.

The session is the `x-session-id` header (Ray Serve's own session header; the proxy puts
it in the request metadata before the body is read, so websockets route by their
handshake). A session sticks to its replica while that replica has room, else the
request goes to the least-loaded replica, and the session moves with it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

# Sessions remembered per router (least recently used forgotten first).
MAX_SESSIONS = 65536


class SessionAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs: object) -> None:
        self.sessions: OrderedDict[str, ReplicaID] = OrderedDict()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        session = pending_request.metadata.session_id if pending_request else ""
        home = self.sessions.get(session) if session else None
        for replica in candidate_replicas:
            if replica.replica_id == home and self._has_room(replica):
                return [[replica]]
        # Least loaded first; among equals, the one that is home to fewer sessions, so new
        # conversations spread over the replicas instead of piling onto the first.
        homes = Counter(self.sessions.values())
        load = lambda r: (self._replica_queue_len_cache.get(r.replica_id) or 0, homes[r.replica_id])
        ranked = sorted(candidate_replicas, key=load)
        return [ranked[:1], ranked[1:]] if ranked else []

    def _has_room(self, replica: RunningReplica) -> bool:
        queued = self._replica_queue_len_cache.get(replica.replica_id)
        return queued is None or queued < replica.max_ongoing_requests

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        session = pending_request.metadata.session_id
        if session:
            self.sessions[session] = replica_id
            self.sessions.move_to_end(session)
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
