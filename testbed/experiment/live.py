"""The fabric, live, in a notebook: :class:`FabricView`.

::

    view = FabricView()
    display(view)                      # the picture and a Stop button
    res = await view.run(experiment)   # the experiment runs in a thread; the view follows it

While a view watches (:meth:`FabricView.watching`, which :meth:`~FabricView.start` enters
around its run), every :class:`~testbed.topologies.net.TestbedNet` of this process is attached
once it is up and detached just before its teardown (:func:`testbed.topologies.net.
watch_networks`: experiments, launched scripts and replays alike), and a thread of the view
reads the data-path engines every ``period_s`` with the provider's telemetry reader
(:class:`testbed.provider.service.Telemetry`) and redraws the fabric in its layers
(:func:`testbed.experiment.plots.fabric_positions`): each link coloured and sized by the
utilisation of its busier direction, labelled where packets queue or were dropped or trimmed
since the last update; each programmable switch with the aggregation memory its jobs hold;
beside it the busiest links, the totals and the memory per job. Only programmable nodes have
engines to read: a link between two bridges stays grey.

:meth:`FabricView.update` reads and redraws once and returns the matplotlib Figure, with or
without a display; :meth:`FabricView.widget` (what a notebook displays) shows it as an image
under a Stop button.

Stop: a target that takes a ``stop`` event (:func:`testbed.experiment.runner.run`,
:func:`testbed.launch.launch`, :func:`testbed.replay.replay`) gets the view's. An experiment
ends before its next run and returns the runs it did (status ``stopped``); a launched job or a
replay stops its ranks and returns what they did. The kernel hears the button while the cell
awaits the run (``await view.run(...)``), not while it blocks on ``.result()``.

Why one module this long: reading, drawing and the widget share one lock and one picture
(a frame is drawn over a background kept from the layout); apart, each would reach into the
others' state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import html
import inspect
import io
import threading
import time
from typing import Any

from testbed.experiment import plots
from testbed.topologies.net import watch_networks

#: Seconds between two updates: a little over two a second, so a slow frame or a busy core
#: still leaves two.
PERIOD_S = 0.45
#: Pixels per inch of the picture (small: one image per update).
DPI = 80
#: Most links labelled at once (text is most of a frame's CPU): where packets were dropped
#: or trimmed since the last update, then the deepest queues.
MAX_LABELS = 8
#: Links the side text lists, busiest first.
BUSIEST = 6
_MIB = float(1 << 20)


def _reader(desc: dict, time_dilation: float):
    """The provider's telemetry reader (link rates, bytes, queues, drops, trims, aggregator
    memory per job) of the fabric ``desc``."""
    from testbed.provider.service import Telemetry  # the HTTP stack: only once a view attaches

    return Telemetry(desc, {}, time_dilation)


def _drawing_modules() -> None:
    import matplotlib.backends.backend_agg  # noqa: F401
    import matplotlib.colorbar  # noqa: F401
    import matplotlib.figure  # noqa: F401
    import matplotlib.image  # noqa: F401


class LiveRun:
    """A run started by :meth:`FabricView.start`: ``await`` it (a notebook cell) or call
    :meth:`result`; either gives the target's return value or raises its exception. An await
    that is given up (the kernel interrupted) asks the run to stop."""

    def __init__(self, future: concurrent.futures.Future, thread: threading.Thread, stop):
        self.future = future
        self.thread = thread
        self._stop = stop

    def result(self, timeout: float | None = None) -> Any:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self) -> Any:
        try:
            return await asyncio.wrap_future(self.future)
        except BaseException:
            if not self.future.done():
                self._stop()
            raise


class FabricView:
    """The live picture of the networks this process runs (see the module docstring).

    What it read last, for code and tests: :attr:`links` (``(src, dst)`` -> utilisation,
    queue_bytes, drops, trims and ``bytes`` since the network was attached), :attr:`memory`
    (switch -> configured and per-job bytes), :attr:`snapshot` (the telemetry's
    :class:`~testbed.provider.schema.FabricSnapshot`); :attr:`updates` (readings of a running
    network), :attr:`attached` and :attr:`detached` (networks), :attr:`cpu_s` (the CPU time
    its updates took, in whichever thread).
    """

    def __init__(self, period_s: float = PERIOD_S, dpi: int = DPI):
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s!r}")
        self.period_s = float(period_s)
        self.dpi = dpi
        self.net = None
        self.desc: dict | None = None
        self.snapshot = None
        self.links: dict[tuple[str, str], dict] = {}
        self.memory: dict[str, dict] = {}
        self.updates = 0
        self.attached = self.detached = 0
        self.cpu_s = 0.0
        self.errors: dict[str, str] = {}
        self.run_future: LiveRun | None = None
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._reader_obj = None
        self._base: dict[tuple[str, str], int] = {}
        self._fig = None
        self._art: dict[str, Any] = {}
        self._drawn_desc: dict | None = None
        self._background = None
        self._last_frame: tuple = (None, b"")
        self._ui: dict[str, Any] = {}
        self._stoppable = False

    # ----- networks ----------------------------------------------------------------------
    def _up(self, net) -> None:
        with self._lock:
            if self.net is not None:  # one network at a time: the first one up
                return
            self.desc = net.topo.describe()
            self._reader_obj = _reader(self.desc, max(1.0, float(net.time_dilation)))
            self.net, self._base, self.links, self.memory = net, {}, {}, {}
            self.attached += 1
            self._collect()  # the counters' baseline
        self._wake.set()

    def _down(self, net) -> None:
        with self._lock:
            if self.net is not net:
                return
            try:
                self._collect()  # what happened since the last update
            finally:
                self._reader_obj.close()
                self.net, self._reader_obj = None, None
                self.detached += 1
            self._push(self._redraw())

    @contextlib.contextmanager
    def watching(self):
        """Follow this process's networks while the block runs: attach each when it is up
        (at once for one up already), update every :attr:`period_s` in a thread of the view,
        detach it before its teardown or when the block ends."""
        _drawing_modules()  # before any network is up: its first update does not pay for them
        quit_ = threading.Event()
        thread = threading.Thread(target=self._loop, args=(quit_,), name="tb-fabric-view",
                                  daemon=True)
        thread.start()
        try:
            with watch_networks(self._up, self._down):
                yield self
        finally:
            quit_.set()
            self._wake.set()
            thread.join()
            if self.net is not None:  # still up: no longer followed
                self._down(self.net)

    def _loop(self, quit_: threading.Event) -> None:
        due = time.monotonic()
        while not quit_.is_set():
            if self.net is not None:
                try:
                    self.update()
                except Exception as e:  # noqa: BLE001 - the picture must not end the run
                    self.errors["update"] = f"{type(e).__name__}: {e}"
                due = max(due + self.period_s, time.monotonic())  # fixed rate, no bursts
            else:
                due = time.monotonic() + self.period_s
            self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()

    # ----- reading -----------------------------------------------------------------------
    def _collect(self) -> None:
        reader, net = self._reader_obj, self.net
        reader.time_dilation = max(1.0, float(getattr(net, "time_dilation", 1.0)))
        snap = reader.collect()
        self.snapshot = snap
        self.errors = {k: v for k, v in self.errors.items() if k == "update"}
        self.errors.update(reader.errors)
        links = {}
        for ln in snap.links:
            key = (ln.src, ln.dst)
            node = reader.ports[key][0]
            # the counter of a node that did not answer this time is unknown, not zero
            counted = ln.bytes if node in reader.engines else None
            queue, drops = ln.queue_bytes, ln.drops
            if counted is not None:
                self._base.setdefault(key, int(counted))
            moved = int(counted) - self._base[key] if counted is not None else \
                self.links.get(key, {}).get("bytes", 0)
            last = self.links.get(key, {})
            links[key] = {"utilisation": ln.utilisation, "queue_bytes": queue,
                          "drops": drops, "trims": ln.trims, "bytes": moved,
                          "rate_mbps": ln.rate_mbps,
                          # since the previous reading: where it hurts now
                          "new_drops": max(drops - last.get("drops", drops), 0),
                          "new_trims": max(ln.trims - last.get("trims", ln.trims), 0)}
        self.links = links
        memory = {}
        for sw in snap.switches:
            agg = reader.engines.get(sw.name, {}).get("aggregator")
            if agg is None:
                continue
            memory[sw.name] = {"configured": int(agg.get("memory", {}).get("configured_bytes",
                                                                            0)),
                               "jobs": dict(sw.allocated_bytes)}
        self.memory = memory
        self.updates += 1

    def update(self):
        """Read the engines of the attached network (if one is), redraw, show it in the
        widget (if one was made); returns the Figure."""
        t0 = time.thread_time()
        try:
            with self._lock:
                if self.net is not None:
                    self._collect()
                fig = self._redraw()
                self._push(fig)
                return fig
        finally:
            self.cpu_s += time.thread_time() - t0

    # ----- drawing -----------------------------------------------------------------------
    def _layout(self) -> None:
        """The figure's artists for :attr:`desc` (made once per topology, then updated)."""
        import matplotlib
        from matplotlib import cm, colors
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        desc = self.desc
        width = max(7.5, 0.5 * len(desc["hosts"]) + 3.5)
        fig = self._fig = Figure(figsize=(width, 4.0), dpi=self.dpi)
        FigureCanvasAgg(fig)
        ax = fig.add_axes((0.01, 0.04, 0.66, 0.84))
        ax.set_axis_off()
        pos = plots.fabric_positions(desc)
        cmap = matplotlib.colormaps["viridis_r"]
        lines, labels = {}, {}
        for ln in desc["links"]:
            (xa, ya), (xb, yb) = pos[ln["a"]], pos[ln["b"]]
            key = (ln["a"], ln["b"])
            lines[key] = ax.plot([xa, xb], [ya, yb], color="#cccccc", lw=1, zorder=1,
                                 solid_capstyle="round")[0]
            # nearer the lower end: lower layers are the wider ones, labels collide less
            t = 0.3 if ya < yb else 0.7
            labels[key] = ax.text(xa + t * (xb - xa), ya + t * (yb - ya), "", fontsize=7,
                                  ha="center", va="center", zorder=3,
                                  bbox={"boxstyle": "round,pad=0.1", "fc": "white",
                                        "ec": "none", "alpha": 0.8})
        plots.draw_fabric_nodes(ax, desc, pos)
        mem = {sw: ax.text(pos[sw][0] + 0.12, pos[sw][1], "", fontsize=7, ha="left",
                           va="center", color="#08519c", zorder=3)
               for sw in desc.get("programmable", []) if sw in desc["switches"]}
        ax.set_ylim(-0.45, max(y for _, y in pos.values()) + 0.45)
        cbar = fig.colorbar(cm.ScalarMappable(norm=colors.Normalize(0, 1), cmap=cmap),
                            cax=fig.add_axes((0.68, 0.12, 0.012, 0.7)))
        cbar.set_label("utilisation", fontsize=7)
        cbar.ax.tick_params(labelsize=6)
        fig.text(0.01, 0.97, f"{desc.get('kind', '')}: links by the utilisation of their "
                 "busier direction; queues, drops and trims; INA memory in use", fontsize=8,
                 va="top")
        self._art = {"cmap": cmap, "lines": lines, "labels": labels, "mem": mem,
                     "side": fig.text(0.75, 0.88, "", fontsize=7, va="top",
                                      family="monospace"),
                     # what changes between updates: drawn over the kept background
                     "moving": [*lines.values(), *labels.values(), *mem.values()]}
        self._drawn_desc, self._background, self._last_frame = desc, None, (None, b"")

    def _redraw(self):
        if self.desc is None:
            return self._empty()
        if self._drawn_desc != self.desc:  # a new topology (a sweep's same one is kept)
            self._layout()
        art, rank = self._art, []
        for (a, b), line in art["lines"].items():
            ends = [d for d in (self.links.get((a, b)), self.links.get((b, a))) if d]
            # in steps of 5 %: finer is not seen, and a frame that did not move is not drawn
            util = round(min(max((d["utilisation"] for d in ends), default=0.0), 1.0) * 20) / 20
            line.set_color(art["cmap"](util) if util else "#cccccc")  # idle: grey
            line.set_linewidth(1 + 5 * util)
            queue, drops, trims = (sum(d[k] for d in ends)
                                   for k in ("queue_bytes", "new_drops", "new_trims"))
            text = " ".join(filter(None, (f"q {queue / 1e3:.0f} kB" if queue else "",
                                          f"+{drops} dropped" if drops else "",
                                          f"+{trims} trimmed" if trims else "")))
            label = art["labels"][(a, b)]
            label.set_text(text)
            label.set_color("red" if drops or trims else "black")
            label.set_visible(False)
            if text:  # the utilisation is the colour; text only where packets wait or die
                rank.append(((drops + trims, queue), label))
        for _, label in sorted(rank, key=lambda r: r[0], reverse=True)[:MAX_LABELS]:
            label.set_visible(True)
        for sw, label in art["mem"].items():
            m = self.memory.get(sw)
            used = sum(m["jobs"].values()) if m else 0
            label.set_text(f"INA {used / _MIB:.2f}/{m['configured'] / _MIB:.0f} MiB"
                           if m else "")
        art["side"].set_text(self._side_text())
        return self._fig

    def _side_text(self) -> str:
        f = getattr(self._reader_obj, "time_dilation", 1.0)
        lines = [("network up" if self.net is not None else "network down")
                 + (f", dilated x{f:g}" if f != 1 else ""), f"update {self.updates}"]
        if self.links:
            total = {k: sum(d[k] for d in self.links.values())
                     for k in ("bytes", "queue_bytes", "drops", "trims")}
            lines += [f"moved {total['bytes'] / 1e6:.1f} MB, queued "
                      f"{total['queue_bytes'] / 1e3:.0f} kB",
                      f"dropped {total['drops']}, trimmed {total['trims']}"]
            busy = [f"  {s}>{d} {v['utilisation']:4.0%} q {v['queue_bytes'] / 1e3:.0f} kB"
                    for (s, d), v in sorted(self.links.items(),
                                            key=lambda kv: -kv[1]["utilisation"])[:BUSIEST]
                    if v["utilisation"] >= 0.005]
            lines += ["busiest links:", *busy] if busy else []
        for sw, m in sorted(self.memory.items()):
            lines.append(f"{sw} INA memory")
            lines += [f"  job {j}: {b / _MIB:.2f} MiB" for j, b in sorted(m["jobs"].items())] \
                or ["  (no job)"]
        lines += [f"! {k}: {v[:40]}" for k, v in sorted(self.errors.items())]
        return "\n".join(lines)

    def _empty(self):
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        if self._fig is None:
            self._fig = Figure(figsize=(7.5, 1.0), dpi=self.dpi)
            FigureCanvasAgg(self._fig)
            self._fig.text(0.5, 0.5, "waiting for a network", ha="center", va="center",
                           color="grey")
        return self._fig

    def png(self) -> bytes:
        """The current picture as PNG bytes (the whole figure, side text included)."""
        with self._lock:
            return _png(self._redraw(), self.dpi)

    def frame(self) -> bytes:
        """The current picture as the widget shows it: JPEG bytes of the figure without its
        side text (the widget shows that as text beside it)."""
        with self._lock:
            return self._frame(self._redraw())

    def _frame(self, fig) -> bytes:
        """``fig`` as a JPEG: its still part (nodes, names, colour bar) rendered once per
        topology and kept as pixels, the links and labels drawn over them, encoded as JPEG
        (a PNG encode took longer than the drawing); the last frame again when nothing
        moved."""
        canvas = fig.canvas
        if not self._art or fig is not self._art["side"].figure:
            canvas.draw()
            return _jpeg(canvas)
        renderer = canvas.get_renderer()  # a new one after a savefig at another size
        if self._background is None or self._background[0] is not renderer:
            hidden = [*self._art["moving"], self._art["side"]]
            shown = [a.get_visible() for a in hidden]
            for a in hidden:
                a.set_visible(False)
            canvas.draw()
            renderer = canvas.get_renderer()
            self._background = (renderer, canvas.copy_from_bbox(fig.bbox))
            for a, v in zip(hidden, shown, strict=True):
                a.set_visible(v)
        moving = self._art["moving"]
        key = tuple((a.get_visible(), a.get_text()) if hasattr(a, "get_text")
                    else (a.get_color(), a.get_linewidth()) for a in moving)
        if key == self._last_frame[0]:  # nothing moved (e.g. between two runs): same picture
            return self._last_frame[1]
        canvas.restore_region(self._background[1])
        for a in moving:
            fig.draw_artist(a)
        self._last_frame = (key, _jpeg(canvas))
        return self._last_frame[1]

    # ----- notebook ----------------------------------------------------------------------
    def widget(self):
        """The ipywidgets box a notebook shows: a Stop button, a status line and the picture
        (an ``<img>`` of class ``tb-fabric-view``), redrawn at every update."""
        import ipywidgets as w  # the [lab] extra: only where a view is displayed

        if not self._ui:
            image = w.Image(format="jpeg", value=self.frame())
            image.add_class("tb-fabric-view")
            button = w.Button(description="Stop", icon="stop", button_style="danger",
                              disabled=not self.running,
                              tooltip="end the run cleanly: the results so far are kept")
            button.on_click(lambda _b: self.stop())
            status, side = w.HTML(), w.HTML()
            self._ui = {"image": image, "button": button, "status": status, "side": side,
                        "box": w.VBox([w.HBox([button, status]), w.HBox([image, side])])}
            self._show_state()
        return self._ui["box"]

    def _status(self) -> str:
        if self.running:
            what = "stopping" if self._stop.is_set() else "running"
        else:
            what = "idle"
        net = "network up" if self.net is not None else "no network"
        return f"<code>{what} &middot; {net} &middot; {self.updates} updates</code>"

    def _push(self, fig) -> None:
        """Show the drawn ``fig`` and the status in the widget, if there is one."""
        if self._ui:
            picture = self._frame(fig)
            if picture != self._ui["image"].value:
                self._ui["image"].value = picture
            self._show_state()

    def _show_state(self) -> None:
        if self._ui:
            self._ui["status"].value = self._status()
            self._ui["side"].value = (f"<pre style='font-size:11px'>"
                                      f"{html.escape(self._side_text())}</pre>")
            self._ui["button"].disabled = not (self.running and self._stoppable) \
                or self._stop.is_set()

    def _show(self) -> None:
        with self._lock:
            self._push(self._redraw())

    def _repr_mimebundle_(self, **kwargs):
        return self.widget()._repr_mimebundle_(**kwargs)

    # ----- runs --------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether a run started by :meth:`start` is under way."""
        return self.run_future is not None and not self.run_future.done()

    def start(self, target, /, *args, **kwargs) -> LiveRun:
        """Run ``target(*args, **kwargs)`` in a thread, watching its networks; a target that
        takes ``stop`` gets the view's Stop event. Returns a :class:`LiveRun`."""
        if self.running:
            raise RuntimeError("the view runs something already: await it, or stop it")
        self._stop = threading.Event()
        self._stoppable = "stop" in inspect.signature(target).parameters
        if self._stoppable:
            kwargs.setdefault("stop", self._stop)
        future: concurrent.futures.Future = concurrent.futures.Future()

        def main() -> None:
            future.set_running_or_notify_cancel()
            try:
                with self.watching():
                    value = target(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to whoever awaits the run
                future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            else:
                future.set_result(value)
            finally:
                with contextlib.suppress(Exception):
                    self._show()

        thread = threading.Thread(target=main, name="tb-fabric-run", daemon=True)
        self.run_future = LiveRun(future, thread, self.stop)
        thread.start()
        with contextlib.suppress(Exception):
            self._show()
        return self.run_future

    def run(self, experiment, **kwargs) -> LiveRun:
        """:func:`testbed.experiment.runner.run` of ``experiment`` (its keyword arguments
        too) through :meth:`start`; ``await`` it for its Results."""
        from testbed.experiment.runner import run

        return self.start(run, experiment, **kwargs)

    def stop(self) -> None:
        """Ask the run started by :meth:`start` to end cleanly (the Stop button)."""
        self._stop.set()
        self._show_state()


def _png(fig, dpi: int) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _jpeg(canvas) -> bytes:
    import numpy as np
    from matplotlib.image import imsave

    buf = io.BytesIO()
    imsave(buf, np.asarray(canvas.buffer_rgba())[..., :3], format="jpeg",
           pil_kwargs={"quality": 90})
    return buf.getvalue()
