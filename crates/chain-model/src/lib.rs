//! The model lives in `tests/model.rs` (stateright is a dev-dependency only; decision 0048).
