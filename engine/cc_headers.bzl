"""cc_headers: the header files of cc_library targets, as plain files.

For genrules (tools/cuda.bzl's nvcc step) that must see another package's headers
without that package exporting them file by file: visibility is checked on the library.
"""

def _cc_headers_impl(ctx):
    headers = depset(transitive = [d[CcInfo].compilation_context.headers for d in ctx.attr.deps])
    return [DefaultInfo(files = headers)]

cc_headers = rule(
    implementation = _cc_headers_impl,
    attrs = {"deps": attr.label_list(providers = [CcInfo])},
)
