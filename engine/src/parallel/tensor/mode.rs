//! How a tensor-parallel group splits a model: the four modes, the grid or cube a number of
//! ranks forms in each, and how many blocks a batch is cut into. The arithmetic lives here
//! once: the layers' groups ([`super::multi_dim::Grid`], [`super::multi_dim::Cube`]) check
//! their sizes with it, an app validates a layout with it before any group exists, and the
//! planner enumerates the modes a group size can run ([`TpMode::for_degree`]).
use crate::error::ensure;
use crate::Result;

/// A tensor-parallel mode; as a command-line value `1d`, `2d`, `2.5d` or `3d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum)]
pub enum TpMode {
    /// Megatron's column/row split of each linear layer.
    #[value(name = "1d")]
    OneD,
    /// SUMMA on a `q x q` grid (Optimus): `q^2` ranks.
    #[value(name = "2d")]
    TwoD,
    /// `depth` layers of a `q x q` grid (Tesseract): `q^2 x depth` ranks.
    #[value(name = "2.5d")]
    TwoHalfD,
    /// A `q x q x q` cube: `q^3` ranks.
    #[value(name = "3d")]
    ThreeD,
}

impl TpMode {
    /// The command-line value (`1d`, `2d`, `2.5d`, `3d`).
    pub fn name(self) -> &'static str {
        match self {
            TpMode::OneD => "1d",
            TpMode::TwoD => "2d",
            TpMode::TwoHalfD => "2.5d",
            TpMode::ThreeD => "3d",
        }
    }

    /// The side `q` of the grid (2D, 2.5D with `depth` layers) or cube (3D) that `ranks` ranks
    /// form (1D: `ranks`); an error says why they form none. `depth` is 1 but in 2.5D.
    pub fn side(self, ranks: usize, depth: usize) -> Result<usize> {
        let root = |n: usize, e: u32| (1..=n).take_while(|r| r.pow(e) <= n).find(|r| r.pow(e) == n);
        match self {
            TpMode::OneD => Ok(ranks),
            TpMode::TwoD => root(ranks, 2).ok_or_else(|| {
                crate::Error::invalid(format!(
                    "2D tensor parallelism needs a square number of ranks (q x q), got {ranks}"
                ))
            }),
            TpMode::TwoHalfD => {
                ensure!(depth >= 1, "2.5D tensor parallelism: depth must be at least 1, got {depth}");
                ensure!(
                    ranks.is_multiple_of(depth),
                    "2.5D tensor parallelism: {ranks} ranks do not divide into depth {depth}"
                );
                root(ranks / depth, 2).ok_or_else(|| {
                    crate::Error::invalid(format!(
                        "2.5D tensor parallelism needs q x q x depth ranks: {ranks} ranks over depth {depth} leave \
                         {}, not a square",
                        ranks / depth
                    ))
                })
            }
            TpMode::ThreeD => root(ranks, 3).ok_or_else(|| {
                crate::Error::invalid(format!(
                    "3D tensor parallelism needs a cube number of ranks (q x q x q), got {ranks}"
                ))
            }),
        }
    }

    /// Into how many blocks a batch is cut over `ranks` ranks (with `depth` layers in 2.5D):
    /// 1 in 1D (every rank sees the whole batch), `depth x q` on a grid, `q^2` on a cube.
    pub fn batch_blocks(self, ranks: usize, depth: usize) -> Result<usize> {
        let q = self.side(ranks, depth)?;
        Ok(match self {
            TpMode::OneD => 1,
            TpMode::TwoD => q,
            TpMode::TwoHalfD => depth * q,
            TpMode::ThreeD => q * q,
        })
    }

    /// The modes, each with its depth (1 but in 2.5D), that a group of `tp` ranks can run
    /// (1D alone for one rank).
    pub fn for_degree(tp: usize) -> Vec<(TpMode, usize)> {
        let mut modes = vec![(TpMode::OneD, 1)];
        if tp <= 1 {
            return modes;
        }
        if tp >= 4 && TpMode::TwoD.side(tp, 1).is_ok() {
            modes.push((TpMode::TwoD, 1));
        }
        for depth in 2..tp {
            if tp / depth >= 4 && TpMode::TwoHalfD.side(tp, depth).is_ok() {
                modes.push((TpMode::TwoHalfD, depth));
            }
        }
        if tp >= 8 && TpMode::ThreeD.side(tp, 1).is_ok() {
            modes.push((TpMode::ThreeD, 1));
        }
        modes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sides_and_batch_blocks() {
        assert_eq!(TpMode::TwoD.side(9, 1).unwrap(), 3);
        assert_eq!(TpMode::TwoHalfD.side(8, 2).unwrap(), 2);
        assert_eq!(TpMode::ThreeD.side(27, 1).unwrap(), 3);
        assert_eq!(TpMode::TwoD.batch_blocks(4, 1).unwrap(), 2);
        assert_eq!(TpMode::TwoHalfD.batch_blocks(8, 2).unwrap(), 4);
        assert_eq!(TpMode::ThreeD.batch_blocks(8, 1).unwrap(), 4);
        assert_eq!(TpMode::OneD.batch_blocks(4, 1).unwrap(), 1);
        let err = TpMode::TwoD.side(2, 1).unwrap_err().to_string();
        assert!(err.contains("2D tensor parallelism needs a square number of ranks (q x q), got 2"), "{err}");
        let err = TpMode::TwoHalfD.side(2, 3).unwrap_err().to_string();
        assert!(err.contains("2.5D tensor parallelism: 2 ranks do not divide into depth 3"), "{err}");
        let err = TpMode::TwoHalfD.side(12, 2).unwrap_err().to_string();
        assert!(err.contains("12 ranks over depth 2 leave 6, not a square"), "{err}");
        assert!(TpMode::ThreeD.side(9, 1).is_err());
    }

    #[test]
    fn names_are_the_flag_values() {
        for mode in [TpMode::OneD, TpMode::TwoD, TpMode::TwoHalfD, TpMode::ThreeD] {
            let value = clap::ValueEnum::to_possible_value(&mode).unwrap();
            assert_eq!(value.get_name(), mode.name());
        }
    }
}
