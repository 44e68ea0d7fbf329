"""kmock's Kubernetes emulator, with what kopf and the operator need of an API server that kmock 0.8 lacks
(shared/notes/kopf-on-kmock.md): server-side metadata (uid, a global resourceVersion, generation, namespace,
creationTimestamp, generateName), 422 for a failed JSON-patch test, LIST with the real resourceVersion and label
selectors, WATCH that replays the events after the requested resourceVersion and subscribes atomically, the
`status` and `scale` subresources. `ApiServer` runs it on a TCP port in a thread of its own, so tests stay sync.

Still approximate: Content-Type is ignored (a dict body merges, RFC 7386; a list is a JSON patch), no strategic
merge, no defaulting or pruning by schemas, no admission, and no garbage collection of owner references.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import secrets
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import apps, dicts, enums, rendering


@attrs.define
class Fault:
    """An injected failure: the next `times` requests of `method` whose path contains `path` answer `status`."""

    method: str
    path: str
    status: int
    times: int = 1
    hits: int = 0


@attrs.define(kw_only=True)
class StrataEmulator(kmock.KubernetesEmulator):
    _version: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, Any, dict]] = attrs.field(factory=list, init=False)  # (resourceVersion, resource, event)
    faults: list[Fault] = attrs.field(factory=list, init=False)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        for fault in self.faults:
            if fault.hits < fault.times and request.method.upper() == fault.method and fault.path in str(request.url):
                fault.hits += 1
                reason = {409: "AlreadyExists", 429: "TooManyRequests", 500: "InternalError"}.get(fault.status,
                                                                                              "ServiceUnavailable")
                return aiohttp.web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                  "reason": reason, "code": fault.status,
                                                  "message": f"injected: {reason}"}, status=fault.status)
        if request.resource is not None and request.action in (enums.action.CREATE, enums.action.UPDATE,
                                                               enums.action.DELETE):
            async with self._lock:
                if request.action == enums.action.CREATE:
                    status, body = 201, await self._create(request)
                elif request.action == enums.action.UPDATE:
                    status, body = 200, await self._patch(request)
                else:
                    status, body = 200, await self._delete(request)
            return aiohttp.web.json_response(body, status=status)
        return await apps.RawHandler._handle(self, request)

    # ------------------------------------------------------------------------------------------ writes

    async def _create(self, request: rendering.Request) -> dict:
        obj = copy.deepcopy(request.data or {})
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not meta.get("name"):
            raise kmock.KubernetesError(422, "Invalid", "metadata.name or metadata.generateName is required")
        namespace = request.namespace or meta.get("namespace")
        if namespace:
            meta["namespace"] = namespace
        key = (request.resource, namespace, meta["name"])
        if key in self._objects and not self._objects[key].deleted:
            raise kmock.KubernetesError(409, "AlreadyExists", f"{meta['name']} already exists")
        if "status" in self._subresources(request) and request.subresource is None:
            obj.pop("status", None)  # as an API server does for a resource with a status subresource
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1,
                    resourceVersion=self._next_version())
        if key in self._objects:
            self._objects[key].create(obj)
        else:
            self._objects[key] = obj
        await self._emit(request.resource, "ADDED", obj)
        return obj

    async def _patch(self, request: rendering.Request) -> dict:
        stored = self._stored(request)
        before = copy.deepcopy(stored.raw)
        data = request.data
        if request.subresource == "scale":
            data = {"spec": {"replicas": ((data or {}).get("spec") or {}).get("replicas")}}
        elif request.subresource == "status" and isinstance(data, dict):
            data = {"status": data.get("status")}
        elif request.subresource is None and isinstance(data, dict) and "status" in self._subresources(request):
            data = {k: v for k, v in data.items() if k != "status"}
        try:
            after = dicts.patch_dict(copy.deepcopy(before), data or {})
        except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as e:
            raise kmock.KubernetesError(422, "Invalid", f"the patch cannot be applied: {e}") from None
        after = dict(after)
        meta = after.setdefault("metadata", {})
        for key in ("name", "namespace", "uid", "creationTimestamp"):  # not the client's to change
            if key in before["metadata"]:
                meta[key] = before["metadata"][key]
        if _essence(after) != _essence(before):
            meta["generation"] = int(before["metadata"].get("generation") or 0) + 1
        meta["resourceVersion"] = self._next_version()
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            stored.history.append(after)
            stored.delete()
            await self._emit(request.resource, "DELETED", after)
            return after
        stored.history.append(after)
        await self._emit(request.resource, "MODIFIED", after)
        return _scale(after) if request.subresource == "scale" else after

    async def _delete(self, request: rendering.Request) -> dict:
        stored = self._stored(request)
        obj = copy.deepcopy(stored.raw)
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            return obj
        meta["resourceVersion"] = self._next_version()
        if meta.get("finalizers"):
            meta.update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0)
            stored.history.append(obj)
            await self._emit(request.resource, "MODIFIED", obj)
            return obj
        stored.history.append(obj)
        stored.delete()
        await self._emit(request.resource, "DELETED", obj)
        return obj

    def _stored(self, request: rendering.Request):
        key = (request.resource, request.namespace, request.name)
        if key not in self._objects or self._objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        return self._objects[key]

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    async def _emit(self, resource, kind: str, obj: dict) -> None:
        event = {"type": kind, "object": copy.deepcopy(obj)}
        self._log.append((self._version, resource, event))
        await self._buses[resource].put(event)

    def _subresources(self, request: rendering.Request) -> set[str]:
        return set(self.resources[request.resource].subresources) if request.resource in self.resources else set()

    # ------------------------------------------------------------------------------------------ reads

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if request.resource not in self._get_resources():
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            items = [copy.deepcopy(o.raw) for o in self._matching(request)]
            version = str(self._version)
        return {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": version}, "items": items}

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""  # the headers go out now, even when nothing happens for a while
        since = request.params.get("resourceVersion")
        bus = self._buses[request.resource]
        async with self._lock:  # the replay and the subscription, with no write between them
            if since and since != "0":
                replay = [e for v, r, e in self._log if v > int(since) and r == request.resource
                          and self._matches(request, e["object"])]
            else:
                replay = [{"type": "ADDED", "object": copy.deepcopy(o.raw)} for o in self._matching(request)]
            mark = await bus.mark()
        try:
            for event in replay:
                yield event
            async for event in bus.stream(since=mark):
                if self._matches(request, event["object"]):
                    yield event
        finally:
            await bus.unmark(mark)

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        async with self._lock:
            obj = copy.deepcopy(self._stored(request).raw)
        return _scale(obj) if request.subresource == "scale" else obj

    def _matching(self, request: rendering.Request) -> list:
        return [o for (resource, _, _), o in self._objects.items()
                if resource == request.resource and not o.deleted and self._matches(request, o.raw)]

    def _matches(self, request: rendering.Request, obj: dict) -> bool:
        meta = obj.get("metadata", {})
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        if request.name is not None and meta.get("name") != request.name:
            return False
        return _selected(meta.get("labels") or {}, request.params.get("labelSelector", ""))


def _selected(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors: `k=v`, `k==v`, `k!=v`, `k`, `!k`, comma-separated."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            ok = labels.get(key.strip()) != value.strip()
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            ok = labels.get(key.strip()) == value.strip()
        elif term.startswith("!"):
            ok = term[1:] not in labels
        else:
            ok = term in labels
        if not ok:
            return False
    return True


def _essence(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _scale(obj: dict) -> dict:
    meta, status = obj["metadata"], obj.get("status") or {}
    return {"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                         if k in meta},
            "spec": {"replicas": (obj.get("spec") or {}).get("replicas", 0)},
            "status": {"replicas": status.get("replicas", 0), "selector": status.get("selector", "")}}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiServer:
    """The emulator on 127.0.0.1 in a thread with its own event loop: `url`, `start()`, `stop()`."""

    def __init__(self, resources: dict[str, kmock.ResourceInfo]):
        self.resources = resources
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)
        self._ready = threading.Event()
        self._stopping: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._emulator: StrataEmulator | None = None

    def start(self) -> ApiServer:
        self._thread.start()
        if not self._ready.wait(30) or self._error:
            raise RuntimeError(f"the emulated API server did not start: {self._error!r}")
        return self

    def inject(self, method: str, path: str, status: int, times: int = 1) -> Fault:
        """Make the next `times` matching requests fail with `status` (counted in the returned Fault's `hits`)."""
        fault = Fault(method.upper(), path, status, times)
        self._loop.call_soon_threadsafe(self._emulator.faults.append, fault)
        return fault

    def stop(self) -> None:
        if self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(30)

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        try:
            async with StrataEmulator() as emulator, kmock.Server(emulator) as server:
                self._emulator = emulator
                emulator.resources.load_bundled()  # kopf needs namespaces, events and the CRDs in discovery
                for key, info in self.resources.items():
                    emulator.resources[key] = info
                self.url = str(server.url).rstrip("/")
                self._ready.set()
                await self._stopping.wait()
        except BaseException as e:
            self._error = e
            self._ready.set()
            raise
