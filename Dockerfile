# moeserve in a container: the release binary on a slim base, run as a non-root user.
#
#   docker build -t moeserve .                                  # CPU (AVX2 / AVX-512 chosen at start)
#   docker build -t moeserve:cuda --build-arg FEATURES=cuda \
#       --build-arg RUNTIME_BASE=nvidia/cuda:13.0.0-runtime-ubuntu24.04 .
#
# The build step is the command CI runs (scripts/test.sh: `cargo build --release --bin moeserve`,
# with --locked so the image builds exactly Cargo.lock); no Docker engine runs in CI here, so the
# image itself is not built there. deploy/kubernetes runs it.
ARG RUST_VERSION=1.95
ARG RUNTIME_BASE=debian:bookworm-slim

FROM rust:${RUST_VERSION}-slim-bookworm AS build
ARG FEATURES=""
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin moeserve ${FEATURES:+--features "$FEATURES"} \
    && cp target/release/moeserve /usr/local/bin/moeserve

FROM ${RUNTIME_BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 moeserve \
    && useradd --system --uid 10001 --gid moeserve --home-dir /data --create-home moeserve
COPY --from=build /usr/local/bin/moeserve /usr/local/bin/moeserve
USER 10001:10001
ENV HF_HOME=/data/huggingface
WORKDIR /data
EXPOSE 8000
ENTRYPOINT ["moeserve"]
# `docker run moeserve serve --model org/name --host 0.0.0.0` (see deploy/kubernetes).
CMD ["--help"]
