"""A model factory whose stage calls record their CPU and wall time per process (bench/insitu_cpu.py)."""
import json, os, time

STAGES = ("embed", "attention_stage", "route", "shared_experts", "dense_mlp", "expert", "final_norm", "lm_head_logits")


class CpuModel:
    def __init__(self, inner, out_dir, role):
        self._inner, self._out, self._role = inner, out_dir, role
        self._stats, self._calls = {}, 0
        self._first = self._last = None

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        fn = getattr(self._inner, name)
        if name not in STAGES:
            return fn

        def wrapped(*a, **kw):
            c0, w0 = time.process_time(), time.perf_counter()
            if self._first is None:
                self._first = c0
            r = fn(*a, **kw)
            c1, w1 = time.process_time(), time.perf_counter()
            s = self._stats.setdefault(name, [0, 0.0, 0.0])
            s[0] += 1; s[1] += c1 - c0; s[2] += w1 - w0
            self._last = c1
            self._calls += 1
            if self._calls % 5 == 0:
                self._dump()
            return r
        return wrapped

    def _dump(self):
        with open(os.path.join(self._out, f"{os.getpid()}.json"), "w") as f:
            json.dump({"role": self._role, "stats": self._stats, "cpu_first": self._first, "cpu_last": self._last,
                       "cpu_now": time.process_time()}, f)


class CpuFactory:
    def __init__(self, inner, out_dir):
        self.inner, self.out_dir = inner, out_dir

    def __call__(self, role, experts):
        return CpuModel(self.inner(role, experts), self.out_dir, role)

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
