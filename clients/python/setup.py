# Build script of the latentd_client package (`pip install ./clients/python`): the gRPC
# stubs are generated while building, from ../../proto, with Debian's protoc and
# grpc_python_plugin, so an installed package always matches the protos of its checkout.
import os
import re
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
# pip (21.3 on) builds a local directory in place, so the checkout's protos are reachable.
PROTO_DIR = os.environ.get("LATENTD_PROTO_DIR", os.path.join(HERE, "..", "..", "proto"))
PROTOS = ["latentd.proto", "health.proto"]
STUBS = ["latentd_pb2", "latentd_pb2_grpc", "health_pb2", "health_pb2_grpc"]


def read_version():
    # One version for daemon and client: server/version.h's kVersion.
    with open(os.path.join(HERE, "..", "..", "server", "version.h")) as f:
        return re.search(r'kVersion\[\] = "([^"]+)"', f.read()).group(1)


class BuildWithStubs(build_py):
    """build_py plus protoc: writes the message and service modules into the package."""

    def run(self):
        super().run()
        out = os.path.join(self.build_lib, "latentd_client")
        os.makedirs(out, exist_ok=True)
        protoc = shutil.which("protoc")
        plugin = shutil.which("grpc_python_plugin")
        if protoc is None or plugin is None:
            raise SystemExit("latentd_client: needs protoc and grpc_python_plugin "
                             "(Debian: apt-get install protobuf-compiler protobuf-compiler-grpc)")
        for name in PROTOS:
            if not os.path.exists(os.path.join(PROTO_DIR, name)):
                raise SystemExit(f"latentd_client: {name} not found in {PROTO_DIR}; build from a latentd "
                                 "checkout (pip install ./clients/python) or set LATENTD_PROTO_DIR")
        subprocess.check_call([protoc, f"-I{PROTO_DIR}", f"--python_out={out}", f"--grpc_python_out={out}",
                               f"--plugin=protoc-gen-grpc_python={plugin}",
                               *[os.path.join(PROTO_DIR, p) for p in PROTOS]])
        # The service modules import their messages as top-level modules; inside the
        # package they must be relative.
        for grpc_module in ("latentd_pb2_grpc", "health_pb2_grpc"):
            path = os.path.join(out, grpc_module + ".py")
            with open(path) as f:
                text = f.read()
            text = re.sub(r"^import (latentd_pb2|health_pb2) as", r"from . import \1 as", text, flags=re.M)
            with open(path, "w") as f:
                f.write(text)

    def get_outputs(self, include_bytecode=1):
        # Listed so that installers record (and uninstall) the generated modules too.
        generated = [os.path.join(self.build_lib, "latentd_client", s + ".py") for s in STUBS]
        return super().get_outputs(include_bytecode) + generated


setup(
    name="latentd-client",
    version=read_version(),
    description="Python client of latentd.v1.DecodeService (MLA decode attention over gRPC)",
    package_dir={"": "src"},
    packages=["latentd_client"],
    python_requires=">=3.9",
    # Debian's python3-grpcio, python3-protobuf and python3-numpy provide these.
    install_requires=["grpcio", "protobuf", "numpy"],
    cmdclass={"build_py": BuildWithStubs},
)
