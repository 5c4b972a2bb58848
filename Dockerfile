# Build: docker build -t aether-proxy .
# BoringSSL is compiled from source, which needs cmake and clang (libclang for bindgen).
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake clang libclang-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked

FROM debian:bookworm-slim
# iptables: the init container runs `aether-proxy redirect --apply` from this image.
RUN apt-get update && apt-get install -y --no-install-recommends iptables \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/aether-proxy /usr/local/bin/aether-proxy
# 15001 outbound, 15008 inbound (mTLS), 15000 admin
EXPOSE 15001 15008 15000
ENTRYPOINT ["/usr/local/bin/aether-proxy"]
CMD ["run", "--config", "/etc/aether/config.yaml"]
