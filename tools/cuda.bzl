"""cuda_library: compiles .cu files with the system nvcc (offline, no rules_cuda).

Each .cu becomes one object through a genrule; ptxas's resource report (registers,
shared memory, spills per kernel) is kept beside it as <name>.ptxas.txt so the test
command can print it and fail on spills. Under --config=nocuda the targets are
incompatible and skipped.
"""

NVCC = "/usr/local/cuda/bin/nvcc"

# SM80 machine code (A100, also runs on sm_86/sm_89), the same source as native Hopper
# machine code, and compute_80 PTX for later GPUs.
NVCC_ARCH_FLAGS = " ".join([
    "-gencode arch=compute_80,code=sm_80",
    "-gencode arch=compute_80,code=sm_90",
    "-gencode arch=compute_80,code=compute_80",
])

NVCC_FLAGS = " ".join([
    "-std=c++17",
    "-O3",
    "-lineinfo",
    "--expt-relaxed-constexpr",
    "-Xcompiler -fPIC",
    "-Xcompiler -Wall",
    "-Xptxas -v",
    "-I.",
])

def cuda_only():
    """target_compatible_with for targets that need the CUDA toolkit (skipped under nocuda)."""
    return select({
        "//tools:nocuda": ["//tools:cuda_toolkit"],
        "//conditions:default": [],
    })

def cuda_library(name, srcs, hdrs = [], textual_hdrs = [], deps = [], visibility = None, testonly = False, nvcc_flags = "",
                 arch_flags = NVCC_ARCH_FLAGS):
    """A cc_library whose srcs are .cu files compiled by nvcc.

    Args:
      name: target name.
      srcs: .cu files.
      hdrs: public headers (plain C++), also visible to nvcc.
      textual_hdrs: headers that only .cu files include (.cuh).
      deps: cc_library deps of the resulting library; their headers are not passed to
        nvcc automatically, so list headers that .cu files include in hdrs or textual_hdrs.
      visibility: as usual.
      testonly: as usual.
      nvcc_flags: extra nvcc flags.
      arch_flags: the -gencode list (default: sm_80 and sm_90 machine code, compute_80 PTX).
    """
    objs = []
    reports = []
    for src in srcs:
        stem = src[:-len(".cu")].replace("/", "_")
        obj = "%s_%s.o" % (name, stem)
        report = "%s_%s.ptxas.txt" % (name, stem)
        native.genrule(
            name = "%s_%s_nvcc" % (name, stem),
            srcs = [src] + hdrs + textual_hdrs,
            outs = [obj, report],
            # nvcc names its intermediate files after its pid; inside Bazel's sandbox
            # every action has a small pid of its own namespace, so two concurrent nvcc
            # runs would share /tmp/tmpxft_00000003_* names. A private TMPDIR per action
            # keeps them apart.
            cmd = ("T=$$(mktemp -d) && " +
                   "{ TMPDIR=$$T %s %s %s %s -c $(location %s) -o $(location %s) 2> $(location %s); " +
                   "rc=$$?; rm -rf $$T; " +
                   "if [ $$rc -ne 0 ]; then cat $(location %s) >&2; exit 1; fi; }") % (
                NVCC,
                NVCC_FLAGS,
                arch_flags,
                nvcc_flags,
                src,
                obj,
                report,
                report,
            ),
            target_compatible_with = cuda_only(),
            testonly = testonly,
            message = "nvcc %s" % src,
        )
        objs.append(obj)
        reports.append(report)

    native.filegroup(
        name = name + "_ptxas_reports",
        srcs = reports,
        visibility = ["//visibility:public"],
        # Bazel 4.2's filegroup has no target_compatible_with; depending on the
        # incompatible genrules makes it incompatible under --config=nocuda anyway.
        testonly = testonly,
    )
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        textual_hdrs = textual_hdrs,
        deps = deps + ["//third_party:cudart"],
        visibility = visibility,
        target_compatible_with = cuda_only(),
        testonly = testonly,
        alwayslink = True,
    )

def ptxas_spill_test(name, reports):
    """Fails when any kernel in the given ptxas reports spills registers."""
    native.sh_test(
        name = name,
        srcs = ["//tools:check_ptxas.sh"],
        args = ["$(locations %s)" % r for r in reports],
        data = reports,
        target_compatible_with = cuda_only(),
    )
