"""Kernel launches with less host time per call.

`kernel[grid](*args, **kwargs)` costs ~40 µs of host time on the H100 machine for our
kernels (measured when they took ~60 flat arguments; they now take ~25, with strides and
the descriptor's tensors grouped in tuples): Triton's binder specializes every argument
(integer divisibility, pointer alignment, also inside tuples), hashes the result into a
cache key and builds launch metadata, on every call (tests/gpu/host_overhead.py,
docs/perf-notes.md change 15). Here the first
launch with a given specialization goes through Triton as usual; later launches whose
arguments specialize the same way call the compiled kernel's launcher directly.

Our cache key is finer than Triton's, so it never reuses a kernel Triton would not:
integers and floats by value, tensors by (dtype, is_cuda, 16-byte alignment of the data
pointer), constexpr keywords by value, plus the device, warps and stages. (Each argument
position always gets one Python type from our launchers, so values alone tell the
specializations apart.) Only the launcher of the
compiled kernel is reached into (`CompiledKernel.run` with Triton 3.x's argument order);
`FAST_LAUNCH = False` or any launch hook (a profiler's) takes Triton's own path.
"""
import torch
import triton
from triton import knobs

from .triton_compat import interpreting

FAST_LAUNCH = True
FAST_HITS = 0           # launches that took the direct path (tests read it)
_COMPILED = {}          # our key -> Triton CompiledKernel
_PARAMS = {}            # JITFunction -> its parameter names in signature order
_MAX_ENTRIES = 4096


def _no_launch_hooks():
    """No launch hook installed (Triton's knobs hold empty HookChains by default)."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and (not isinstance(hook, knobs.HookChain) or hook.calls):
            return False
    return True


def direct_launch_allowed() -> bool:
    """Direct launches are on: FAST_LAUNCH, not the interpreter, no launch hook."""
    return FAST_LAUNCH and not interpreting() and _no_launch_hooks()


def param_names(kernel):
    """The kernel's parameter names in signature order (a JITFunction's, or an interpreted
    one's arg_names)."""
    names = _PARAMS.get(kernel)
    if names is None:
        params = getattr(kernel, "params", None)
        names = _PARAMS[kernel] = ([p.name for p in params] if params is not None
                                   else list(kernel.arg_names))
    return names


def _spec_and_pointer(a):
    """(key entry, launcher argument) of one kernel argument; tuple arguments (the kernels
    take grouped strides and the descriptor's tensors as tuples) element by element."""
    if isinstance(a, torch.Tensor):
        p = a.data_ptr()
        return (a.dtype, a.is_cuda, p % 16 == 0), p
    if isinstance(a, tuple):
        pairs = [_spec_and_pointer(x) for x in a]
        return tuple(s for s, _ in pairs), tuple(p for _, p in pairs)
    return a, a


def key_and_pointers(kernel, device, args, kwargs, warps, stages):
    """(cache key, launcher arguments) of one launch, in one pass over the arguments:
    tensors go in as raw pointers, which spares the launcher a data_ptr() call and a
    cuPointerGetAttribute check per tensor (Triton's launch already checked these tensors
    once, and a tensor's key includes is_cuda)."""
    spec = []
    flat = []
    for a in args:
        s, p = _spec_and_pointer(a)
        spec.append(s)
        flat.append(p)
    return (kernel, device, warps, stages, tuple(kwargs.items()), tuple(spec)), flat


def launch(kernel, grid, args, kwargs, warps, stages):
    """kernel[grid](*args, **kwargs, num_warps=warps, num_stages=stages), directly through
    the compiled launcher when an identical specialization was launched before."""
    if not direct_launch_allowed():
        return kernel[grid](*args, **kwargs, num_warps=warps, num_stages=stages)
    device = _device()
    key, flat = key_and_pointers(kernel, device, args, kwargs, warps, stages)
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs, num_warps=warps, num_stages=stages)
        if hasattr(compiled, "result"):         # asynchronous compile mode: not cached
            return compiled
        if len(_COMPILED) >= _MAX_ENTRIES:
            _COMPILED.clear()
        _COMPILED[key] = compiled
        return compiled
    flat += [kwargs[name] for name in param_names(kernel)[len(args):]]
    _run(compiled, _grid3(grid), device, flat)
    return compiled


# ---------------------------------------------------------------- recorded launches
# A call with the same shapes, strides, dtypes, mask and knobs as an earlier one builds the
# same kernel arguments, except the data pointers of its own tensors (inputs, outputs,
# scratch). triton_block records each launch of such a call once, with Slot markers where
# those tensors go, and later calls fill in the pointers and call the compiled launcher:
# no argument lists to build, no per-argument key (~40 µs per launch on the H100 host).


class Slot:
    """Marker for a per-call tensor in recorded kernel arguments, looked up by name."""
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Slot({self.name!r})"


def resolve(args, tensors):
    """args with each Slot replaced by tensors[slot.name]."""
    return tuple(tensors[a.name] if type(a) is Slot else a for a in args)


class LaunchPlan:
    """One recorded launch: the compiled kernel, its grid and its flat argument list with
    the per-call tensors' positions (`slots`: (position, name))."""
    __slots__ = ("compiled", "grid", "device", "flat", "slots")

    def __init__(self, compiled, grid, device, flat, slots):
        self.compiled, self.grid, self.device, self.flat, self.slots = (
            compiled, grid, device, flat, slots)

    def __call__(self, pointers):
        """Launch with pointers[name] for every slot (alignment checked by the caller)."""
        flat = self.flat.copy()
        for pos, name in self.slots:
            flat[pos] = pointers[name]
        _run(self.compiled, self.grid, self.device, flat)


def make_plan(compiled, kernel, grid, args, kwargs, tensors):
    """A LaunchPlan of the launch kernel[grid](*resolve(args, tensors), **kwargs) that just
    ran and returned `compiled`; None where launches cannot go direct. Tensors other than
    Slots are fixed: the caller keeps them alive for as long as it keeps the plan."""
    if not direct_launch_allowed() or not hasattr(compiled, "packed_metadata"):
        return None
    names = param_names(kernel)
    flat, slots = [], []
    for pos, a in enumerate(args):
        if type(a) is Slot:
            slots.append((pos, a.name))
            flat.append(0)
        else:
            flat.append(_spec_and_pointer(a)[1])
    flat += [kwargs[name] for name in names[len(args):]]
    return LaunchPlan(compiled, _grid3(grid), _device(), flat, slots)


def _run(compiled, grid3, device, flat):
    """The compiled kernel's own launcher (Triton 3.x argument order), no hooks."""
    global FAST_HITS
    compiled.run(grid3[0], grid3[1], grid3[2], _stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *flat)
    FAST_HITS += 1


def _grid3(grid):
    g = tuple(grid) + (1, 1)
    return g[:3]


def _device():
    return torch.cuda.current_device()


def _stream(device):
    return triton.runtime.driver.active.get_current_stream(device)
