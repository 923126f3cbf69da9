//! OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status.

use axum::extract::rejection::JsonRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use specula_engine::RequestError;

/// An error answered to the client in OpenAI's format.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `server_error`, ...
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<String>,
    /// Seconds for a `Retry-After` header (429 answers).
    pub retry_after: Option<u32>,
    /// The methods for an `Allow` header (405 answers the handler gives itself).
    pub allow: Option<&'static str>,
    /// Whether a `WWW-Authenticate: Bearer` header goes with it (401 answers).
    pub bearer_challenge: bool,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
            allow: None,
            bearer_challenge: false,
        }
    }

    /// 400 `invalid_request_error` naming the offending parameter, code `invalid_value` unless
    /// [`ApiError::with_code`] names another (`invalid_type`, `unknown_parameter`, ...): every
    /// 4xx body has a code a client can branch on.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        let mut e = Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message);
        e.param = param.map(str::to_string);
        e.code = Some("invalid_value".to_string());
        e
    }

    pub fn with_code(mut self, code: &str) -> Self {
        self.code = Some(code.to_string());
        self
    }

    /// 404 for a model id this server does not serve.
    pub fn model_not_found(model: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("The model `{model}` does not exist or you do not have access to it."),
        );
        e.param = Some("model".to_string());
        e.code = Some("model_not_found".to_string());
        e
    }

    /// 404 for a path with no route.
    pub fn route_not_found(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("Unknown request URL: {method} {path}."),
        )
        .with_code("unknown_url")
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("Method {method} is not allowed for {path}."),
        )
        .with_code("method_not_allowed")
    }

    /// 405 for a path a handler owns, with the methods it does allow (`Allow`).
    pub fn method_not_allowed_here(method: &str, path: &str, allow: &'static str) -> Self {
        let mut e = Self::method_not_allowed(method, path);
        e.allow = Some(allow);
        e
    }

    /// 429: the queue of waiting requests is full.
    pub fn queue_full(max_queue: usize) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_exceeded",
            format!("The server is busy: {max_queue} requests are already waiting. Retry shortly."),
        );
        e.code = Some("queue_full".to_string());
        e.retry_after = Some(1);
        e
    }

    /// 401 `authentication_error`, code `invalid_api_key`: the request carries no API key
    /// (`missing`) or none this server accepts. The key sent is never echoed.
    pub fn invalid_api_key(missing: bool) -> Self {
        let message = if missing {
            "Missing API key: send it as `Authorization: Bearer KEY` or `x-api-key: KEY`."
        } else {
            "Incorrect API key provided."
        };
        let mut e = Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message).with_code("invalid_api_key");
        e.bearer_challenge = true;
        e
    }

    /// 403, code `invalid_host`: a server bound to loopback got a request whose `Host` names
    /// another host (what a DNS rebinding attack sends).
    pub fn invalid_host() -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            "This server is bound to a loopback address and answers only requests addressed to \
             localhost, 127.0.0.1 or [::1] (the Host header).",
        )
        .with_code("invalid_host")
    }

    /// 408, code `request_timeout`: the request's body did not arrive within `limit`.
    pub fn request_timeout(limit: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!("The request body did not arrive within {} seconds.", limit.as_secs()),
        )
        .with_code("request_timeout")
    }

    /// 413, code `request_too_large`: the body is over `limit` bytes.
    pub fn body_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("The request body is larger than the server's limit of {limit} bytes."),
        )
        .with_code("request_too_large")
    }

    /// 400, code `invalid_body`: the body could not be read (the client broke it off).
    pub fn unreadable_body() -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "The request body could not be read.",
        )
        .with_code("invalid_body")
    }

    /// 500 `server_error`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// Map an engine error; `prompt_param` names the request field holding the prompt
    /// (`messages` or `prompt`).
    pub fn from_request_error(e: &RequestError, prompt_param: &str) -> Self {
        let message = e.to_string();
        match e {
            RequestError::PromptTooLong { .. } | RequestError::PromptTooLongBytes { .. } => {
                Self::invalid(message, Some(prompt_param)).with_code("context_length_exceeded")
            }
            RequestError::MaxTokensTooLarge { .. } => {
                Self::invalid(message, Some("max_tokens")).with_code("context_length_exceeded")
            }
            RequestError::EmptyPrompt => Self::invalid(message, Some(prompt_param)),
            RequestError::InvalidParameter(m) => {
                // The engine's messages start with the parameter name ("top_p must be ...").
                let first = m.split_whitespace().next().unwrap_or("");
                let param = PARAM_NAMES.iter().find(|p| **p == first).copied();
                let param = match param {
                    Some(p) => Some(p),
                    None if m.starts_with("speculative") || m.starts_with("draft_max") => Some("spec"),
                    None if m.starts_with("chat template") => Some("messages"),
                    None if m.starts_with("response_format") => Some("response_format"),
                    None if m.starts_with("tools") => Some("tools"),
                    None if m.starts_with("prompt") => Some(prompt_param),
                    None => None,
                };
                // OpenAI's wording ("Invalid 'top_p': ...") where the parameter is known; the
                // engine's own prefix ("invalid request: ") says nothing a 400 does not.
                // The engine's message starts with the name too ("top_p must be ..."): said once.
                let message = match param {
                    Some(p) => {
                        let rest = m
                            .strip_prefix(p)
                            .map_or(m.as_str(), |r| r.trim_start_matches(':').trim_start());
                        format!("Invalid '{p}': {rest}")
                    }
                    None => m.clone(),
                };
                Self::invalid(message, param)
            }
            RequestError::Internal(_) => Self::internal(message),
        }
    }

    /// The same error naming `field` where it names `max_tokens`: the length limit as the
    /// request spelt it (`max_completion_tokens` wins over `max_tokens` when both are given).
    pub fn naming_max_tokens(mut self, field: &str) -> Self {
        if self.param.as_deref() == Some("max_tokens") && field != "max_tokens" {
            self.param = Some(field.to_string());
            self.message = self.message.replace("max_tokens (", &format!("{field} ("));
        }
        self
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

const PARAM_NAMES: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "top_logprobs",
    "logprobs",
    "max_tokens",
];

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if let Some(a) = self.allow {
            resp.headers_mut().insert(header::ALLOW, HeaderValue::from_static(a));
        }
        if self.bearer_challenge {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        let status = r.status();
        let kind = if status.is_server_error() {
            "server_error"
        } else {
            "invalid_request_error"
        };
        let (message, code) = match &r {
            JsonRejection::JsonSyntaxError(_) => (
                format!("We could not parse the JSON body of your request. ({})", r.body_text()),
                "invalid_json",
            ),
            JsonRejection::MissingJsonContentType(_) => (r.body_text(), "unsupported_media_type"),
            _ if status == StatusCode::PAYLOAD_TOO_LARGE => (r.body_text(), "request_too_large"),
            _ if status.is_server_error() => (r.body_text(), "server_error"),
            _ => (r.body_text(), "invalid_body"),
        };
        Self::new(status, kind, message).with_code(code)
    }
}
