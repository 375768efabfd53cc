"""The provider's journal: jobs, leases, plans, the plan log and switch registrations in SQLite.

A provider that is killed (``kill -9``, a crash, a reboot of its process) and started again
with the same journal resumes where it stopped: the same jobs with the same leases, plans and
plan versions, and the switch registrations its workers use (job id, tree, first round,
ports), which it checks against the switches (``SwitchConfigurator.adopt``). The service
saves after every call that changed something, in one transaction, so the file always holds a
state the provider was in.

Why SQLite and not a JSON file: a transaction is atomic and durable across a crash of the
writer with no rename dance, the log grows by appends, and ``sqlite3`` (standard library) can
read the journal of a dead provider for a post-mortem::

    sqlite3 provider.db 'select job, json_extract(plan, "$.algo") from plans'

Leases are times on the machine's monotonic clock (``CLOCK_MONOTONIC``, shared by every
process since boot), so a lease keeps running while the provider is down; the journal records
the boot it was written in, and a journal of an earlier boot is refused: its leases, and the
switches it registered on, are gone.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

SCHEMA = """
create table if not exists meta (key text primary key, value text not null);
create table if not exists jobs (job text primary key, request text not null,
    admitted_s real not null, expires_s real not null, iteration integer, checks text);
create table if not exists plans (job text primary key, plan text not null,
    version integer not null, applies_at integer);
create table if not exists log (seq integer primary key, entry text not null);
create table if not exists registrations (job text primary key, job_id integer not null,
    plan text not null, registration text not null);
create table if not exists retiring (job_id integer primary key, job text not null,
    version integer not null, registration text not null);
create table if not exists following (job text primary key, version integer not null);
"""

#: What the journal keeps of a job's hints check (``FabricManager``): the request with the
#: observed figures, the verdict, the counters it started from.
CHECKS = ("effective", "check", "baseline")


def boot_id() -> str:
    """This boot of the machine (the kernel's random boot id)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: the journal cannot tell boots apart
        return "unknown"


class JournalError(ValueError):
    """A journal that cannot be used for this provider (the message says why and what to do)."""


class Journal:
    """The SQLite file at ``path`` (created with its folder when missing)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # the service's lock serialises every use; its threads take turns
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            raise JournalError(f"{self.path} is not a provider journal ({e}); give another "
                               "--journal path or remove the file") from None
        self._logged = self._count("log")

    def _count(self, table: str) -> int:
        return int(self._db.execute(f"select count(*) from {table}").fetchone()[0])

    def empty(self) -> bool:
        """Whether nothing was saved yet."""
        return self._count("meta") == 0

    def save(self, state: dict, registrations: dict[str, dict]) -> None:
        """Replace the journal's state by ``state`` (``FabricManager.state()``) and
        ``registrations`` (per job: ``job_id``, ``plan``, ``registration`` of the plan it
        runs, when that one aggregates in the network; ``retiring``: the registrations of
        plans its workers may still run, each with the plan ``version`` that replaced it, its
        ``job_id`` and ``registration``; ``following``: the plan version its tenant said its
        workers run), appending the log entries not yet saved, in one transaction."""
        db = self._db
        db.execute("begin immediate")
        try:
            meta = {"boot_id": boot_id(), "topology": state["topology"],
                    "hosts": json.dumps(state["hosts"])}
            db.executemany("insert or replace into meta values (?, ?)", meta.items())
            db.execute("delete from jobs")
            db.executemany("insert into jobs values (?, ?, ?, ?, ?, ?)", [
                (n, json.dumps(j["request"]), j["admitted_s"], j["expires_s"], j["iteration"],
                 json.dumps({k: j.get(k) for k in CHECKS})) for n, j in state["jobs"].items()])
            db.execute("delete from plans")
            db.executemany("insert into plans values (?, ?, ?, ?)", [
                (n, json.dumps(p), state["plan_versions"].get(n, 0),
                 state["applies_at"].get(n)) for n, p in state["plans"].items()])
            log = state["log"]
            if len(log) < self._logged:  # a restored manager with a shorter log: rewrite it
                db.execute("delete from log")
                self._logged = 0
            db.executemany("insert into log values (?, ?)",
                           [(i, json.dumps(e)) for i, e in enumerate(log) if i >= self._logged])
            db.execute("delete from registrations")
            db.executemany("insert into registrations values (?, ?, ?, ?)", [
                (n, int(r["job_id"]), json.dumps(r["plan"]), json.dumps(r["registration"]))
                for n, r in registrations.items() if r.get("registration") is not None])
            db.execute("delete from retiring")
            db.executemany("insert into retiring values (?, ?, ?, ?)", [
                (int(x["job_id"]), n, int(x["version"]), json.dumps(x["registration"]))
                for n, r in registrations.items() for x in r.get("retiring", ())])
            db.execute("delete from following")
            db.executemany("insert into following values (?, ?)", [
                (n, int(r["following"])) for n, r in registrations.items()
                if r.get("following") is not None])
            db.execute("commit")
        except BaseException:
            db.execute("rollback")
            raise
        self._logged = len(log)

    def load(self) -> tuple[dict, dict[str, dict]] | None:
        """``(state, registrations)`` as saved, or None for a new journal. Raises
        :class:`JournalError` for a journal of an earlier boot."""
        if self.empty():
            return None
        meta = dict(self._db.execute("select key, value from meta"))
        if meta.get("boot_id") != boot_id():
            raise JournalError(
                f"{self.path} was written before this machine last booted: its leases and "
                "the switch registrations it records are gone; remove it (or give another "
                "--journal path) to start afresh")
        state: dict = {"topology": meta["topology"], "hosts": json.loads(meta["hosts"]),
                       "jobs": {}, "plans": {}, "plan_versions": {}, "applies_at": {}}
        for job, req, adm, exp, it, checks in self._db.execute("select * from jobs"):
            state["jobs"][job] = {"request": json.loads(req), "admitted_s": adm,
                                  "expires_s": exp, "iteration": it, **json.loads(checks)}
        for job, plan, version, applies in self._db.execute("select * from plans"):
            state["plans"][job] = json.loads(plan)
            state["plan_versions"][job] = version
            state["applies_at"][job] = applies
        state["log"] = [json.loads(e) for (e,) in
                        self._db.execute("select entry from log order by seq")]
        regs: dict[str, dict] = {
            job: {"job_id": jid, "plan": json.loads(plan), "registration": json.loads(reg)}
            for job, jid, plan, reg in self._db.execute("select * from registrations")}
        for jid, job, version, reg in self._db.execute(
                "select * from retiring order by version, job_id"):
            regs.setdefault(job, {}).setdefault("retiring", []).append(
                {"job_id": jid, "version": version, "registration": json.loads(reg)})
        for job, version in self._db.execute("select * from following"):
            regs.setdefault(job, {})["following"] = version
        return state, regs

    def close(self) -> None:
        """Close the file (everything saved is in it)."""
        self._db.close()
