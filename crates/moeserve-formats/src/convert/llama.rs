//! Reading a dense llama-architecture GGUF as a Mixtral layout: hyper-parameters from the
//! `llama.*` keys, the GGUF name of every tensor, shape checks, and undoing llama.cpp's
//! rotary permutation of `attn_q`/`attn_k`.
//!
//! Follows llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.permute`, the `blk.N.*` tensor
//! names) and `llama-model.cpp` (keys and their defaults).

use std::path::Path;

use crate::gguf::{GgufFile, gguf_error};
use crate::{FormatError, Result};

/// Hyper-parameters of a dense llama GGUF.
#[derive(Clone, Debug, PartialEq)]
pub struct DenseLlama {
    pub num_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub context_length: usize,
    /// No `output.weight`: the LM head is the token embedding.
    pub tied_embeddings: bool,
}

impl DenseLlama {
    pub fn from_gguf(gguf: &GgufFile) -> Result<DenseLlama> {
        let path = gguf.path();
        let arch = gguf.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(FormatError::UnsupportedArchitecture {
                path: path.to_path_buf(),
                found: arch.to_string(),
                supported: "llama",
            });
        }
        if gguf.opt_usize("llama.expert_count")?.unwrap_or(0) > 0 {
            return Err(gguf_error(
                path,
                "the model already has experts (llama.expert_count > 0); expected a dense model",
            ));
        }
        if let Some(scaling) = gguf.opt_str("llama.rope.scaling.type")?
            && scaling != "none"
        {
            return Err(gguf_error(
                path,
                format!("rope scaling `{scaling}` is not supported"),
            ));
        }
        let num_heads = gguf.get_usize("llama.attention.head_count")?;
        let hidden_size = gguf.get_usize("llama.embedding_length")?;
        if num_heads == 0 || !hidden_size.is_multiple_of(num_heads) {
            return Err(gguf_error(
                path,
                format!("head count {num_heads} does not divide hidden size {hidden_size}"),
            ));
        }
        let head_dim = gguf
            .opt_usize("llama.attention.key_length")?
            .unwrap_or(hidden_size / num_heads);
        let value_dim = gguf
            .opt_usize("llama.attention.value_length")?
            .unwrap_or(head_dim);
        let rope_dim = gguf
            .opt_usize("llama.rope.dimension_count")?
            .unwrap_or(head_dim);
        if value_dim != head_dim || rope_dim != head_dim || !head_dim.is_multiple_of(2) {
            return Err(gguf_error(
                path,
                format!(
                    "unsupported attention shape: key length {head_dim}, value length \
                     {value_dim}, rotary dimensions {rope_dim} (need all equal and even)"
                ),
            ));
        }
        let num_kv_heads = gguf
            .opt_usize("llama.attention.head_count_kv")?
            .unwrap_or(num_heads);
        if num_kv_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
            return Err(gguf_error(
                path,
                format!("{num_heads} heads are not a multiple of {num_kv_heads} kv heads"),
            ));
        }
        let embedding = gguf.tensor_info("token_embd.weight")?;
        let vocab_size = match embedding.shape.as_slice() {
            &[vocab, h] if h == hidden_size => vocab,
            other => {
                return Err(FormatError::TensorShape {
                    path: path.to_path_buf(),
                    name: "token_embd.weight".to_string(),
                    expected: vec![0, hidden_size],
                    got: other.to_vec(),
                });
            }
        };
        let llama = DenseLlama {
            num_layers: gguf.get_usize("llama.block_count")?,
            hidden_size,
            intermediate_size: gguf.get_usize("llama.feed_forward_length")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: gguf
                .opt_f64("llama.attention.layer_norm_rms_epsilon")?
                .unwrap_or(1e-5) as f32,
            rope_theta: gguf.opt_f64("llama.rope.freq_base")?.unwrap_or(10_000.0),
            context_length: gguf.opt_usize("llama.context_length")?.unwrap_or(2048),
            tied_embeddings: !gguf.has_tensor("output.weight"),
        };
        llama.check_tensors(gguf)?;
        Ok(llama)
    }

    /// Every tensor the conversion reads, with its expected row-major shape.
    pub fn expected_tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let (q, kv) = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        );
        let mut out = vec![("token_embd.weight".to_string(), vec![self.vocab_size, h])];
        out.push(("output_norm.weight".to_string(), vec![h]));
        if !self.tied_embeddings {
            out.push(("output.weight".to_string(), vec![self.vocab_size, h]));
        }
        for l in 0..self.num_layers {
            let per_layer = [
                ("attn_norm", vec![h]),
                ("ffn_norm", vec![h]),
                ("attn_q", vec![q, h]),
                ("attn_k", vec![kv, h]),
                ("attn_v", vec![kv, h]),
                ("attn_output", vec![h, q]),
                ("ffn_gate", vec![i, h]),
                ("ffn_up", vec![i, h]),
                ("ffn_down", vec![h, i]),
            ];
            out.extend(
                per_layer
                    .into_iter()
                    .map(|(name, shape)| (format!("blk.{l}.{name}.weight"), shape)),
            );
        }
        out
    }

    /// All expected tensors exist with the right shape and a decodable type, and the file
    /// holds nothing the conversion would silently drop.
    fn check_tensors(&self, gguf: &GgufFile) -> Result<()> {
        let expected = self.expected_tensors();
        for (name, shape) in &expected {
            let info = gguf.dequantizable(name)?;
            if &info.shape != shape {
                return Err(FormatError::TensorShape {
                    path: gguf.path().to_path_buf(),
                    name: name.clone(),
                    expected: shape.clone(),
                    got: info.shape.clone(),
                });
            }
        }
        let known: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        if let Some(extra) = gguf
            .tensors()
            .iter()
            .find(|t| !known.contains(t.name.as_str()))
        {
            return Err(gguf_error(
                gguf.path(),
                format!(
                    "tensor `{}` has no place in a Mixtral checkpoint (biases, rope_freqs and \
                     other extras are not supported)",
                    extra.name
                ),
            ));
        }
        Ok(())
    }
}

/// Undoes llama.cpp's `LlamaModel.permute` on the rows of a `[n_head * head_dim, cols]`
/// matrix: GGUF row `h*hd + 2*j + i` goes back to HF row `h*hd + i*hd/2 + j`.
pub fn unpermute_rope_rows(
    values: &mut [f32],
    n_head: usize,
    cols: usize,
    path: &Path,
) -> Result<()> {
    let rows = values.len().checked_div(cols).unwrap_or(0);
    let head_dim = rows.checked_div(n_head).unwrap_or(0);
    if head_dim == 0
        || rows * cols != values.len()
        || head_dim * n_head != rows
        || !head_dim.is_multiple_of(2)
    {
        return Err(gguf_error(
            path,
            format!(
                "cannot un-permute {} values as {n_head} heads of even size × {cols} columns",
                values.len()
            ),
        ));
    }
    let half = head_dim / 2;
    let gguf_order = values.to_vec();
    for h in 0..n_head {
        for i in 0..2 {
            for j in 0..half {
                let hf_row = h * head_dim + i * half + j;
                let gguf_row = h * head_dim + 2 * j + i;
                values[hf_row * cols..(hf_row + 1) * cols]
                    .copy_from_slice(&gguf_order[gguf_row * cols..(gguf_row + 1) * cols]);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_restores_the_hf_row_order() {
        // One head of dim 4, one column: llama.cpp stores HF rows [0, 1, 2, 3] as [0, 2, 1, 3].
        let mut values = vec![0.0, 2.0, 1.0, 3.0];
        unpermute_rope_rows(&mut values, 1, 1, Path::new("x.gguf")).expect("valid shape");
        assert_eq!(values, vec![0.0, 1.0, 2.0, 3.0]);
        // Two heads of dim 4, two columns: each head is handled on its own.
        let mut values: Vec<f32> = [0, 2, 1, 3, 4, 6, 5, 7]
            .iter()
            .flat_map(|&r| [r as f32, r as f32 + 0.5])
            .collect();
        unpermute_rope_rows(&mut values, 2, 2, Path::new("x.gguf")).expect("valid shape");
        let expected: Vec<f32> = (0..8).flat_map(|r| [r as f32, r as f32 + 0.5]).collect();
        assert_eq!(values, expected);
    }

    #[test]
    fn unpermute_rejects_odd_heads() {
        let err =
            unpermute_rope_rows(&mut [0.0; 6], 2, 1, Path::new("x.gguf")).expect_err("head dim 3");
        assert!(err.to_string().contains("x.gguf"), "{err}");
    }
}
