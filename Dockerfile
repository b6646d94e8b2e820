# The AuK render service image: the API (`python -m api`) and the GPU worker (`auk worker`) run from it.
# pip resolves torch from PyPI, whose Linux x86_64 wheel carries CUDA; the API never imports it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# Dependencies first, so a source change does not reinstall torch: install the declared requirements from
# pyproject.toml alone, then the project itself without its (already installed) dependencies.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

COPY . .
RUN pip install --no-deps . \
    && useradd --create-home --uid 10001 auk \
    && mkdir -p /checkpoints && chown auk /checkpoints
USER auk

ENV AUK_DEPLOY_CONFIG=/app/config/auk.yaml
EXPOSE 8000
CMD ["python", "-m", "api"]
