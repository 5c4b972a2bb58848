# Build: docker build -t aether-proxy .
# BoringSSL is compiled from source, which needs cmake and clang (libclang for bindgen).
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake clang libclang-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# Profile-guided: an instrumented build runs `demo --load` on the build container's loopback,
# then the release build uses that profile (docs/development.md). The build's own
# triple keeps the result apart from plain `cargo build` output.
RUN .ci/pgo-build 20 && cp "target/$(rustc -vV | sed -n 's/^host: //p')/release/aether-proxy" /aether-proxy

FROM debian:bookworm-slim
# iptables for `aether-proxy redirect --apply` in the pod's init container (SPEC section 10).
RUN apt-get update && apt-get install -y --no-install-recommends iptables \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /aether-proxy /usr/local/bin/aether-proxy
# 15001 outbound, 15008 inbound (mTLS), 15000 admin (loopback), 15021 health probes
EXPOSE 15001 15008 15000 15021
# The proxy's own uid: the capture rules exempt it, so its connections are never redirected.
USER 1337:1337
ENTRYPOINT ["/usr/local/bin/aether-proxy"]
CMD ["run", "--config", "/etc/aether/config.yaml"]
